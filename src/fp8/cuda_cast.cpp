// Without CUDA (a LibTorch without it, or no nvcc): no FP8 kernels; the
// casts and scales never ask for them then (built() is false).

#include "cuda_cast.h"

#include <c10/util/Exception.h>

#if !defined(AMPX_WITH_CUDA)

namespace ampx {
namespace fp8 {
namespace detail {
namespace cuda {

namespace {
[[noreturn]] void none() {
  TORCH_INTERNAL_ASSERT(false, "ampx::fp8: this build of ampx has no CUDA kernels");
}
}  // namespace

bool built() {
  return false;
}

CastOut cast(const at::Tensor&, Fp8Format, const at::Tensor&, bool, const at::Tensor&) {
  none();
}

at::Tensor amax(const at::Tensor&) {
  none();
}

void current_scale(const at::Tensor&, float, float, bool, const at::Tensor&, const at::Tensor&) {
  none();
}

void delayed_update(const std::vector<DelayedArgs>&, c10::Device) {
  none();
}

}  // namespace cuda
}  // namespace detail
}  // namespace fp8
}  // namespace ampx

#endif
