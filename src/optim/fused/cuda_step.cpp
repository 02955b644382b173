// Without CUDA (a LibTorch without it, or no nvcc): no fused CUDA step; the
// optimizers never ask for one then (built() is false).

#include "cuda_step.h"

#include <c10/util/Exception.h>

#if !defined(AMPX_WITH_CUDA)

namespace ampx {
namespace optim {
namespace detail {
namespace cuda {

bool built() {
  return false;
}

void fused_step(const std::vector<DeviceParam>&, c10::Device, const at::Tensor&, const at::Tensor&,
                uint64_t, MetaCache&) {
  TORCH_INTERNAL_ASSERT(false, "ampx::optim: this build of ampx has no CUDA kernels");
}

}  // namespace cuda
}  // namespace detail
}  // namespace optim
}  // namespace ampx

#endif
