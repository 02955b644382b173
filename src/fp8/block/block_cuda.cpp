// Without CUDA (a LibTorch without it, or no nvcc): no block-scaled kernels;
// BlockTensor refuses CUDA tensors then (built() is false).

#include "block_cuda.h"

#include <c10/util/Exception.h>

#if !defined(AMPX_WITH_CUDA)

namespace ampx {
namespace fp8 {
namespace detail {
namespace cuda_block {

namespace {
[[noreturn]] void none() {
  TORCH_INTERNAL_ASSERT(false, "ampx::fp8: this build of ampx has no block-scaled CUDA kernels");
}
}  // namespace

bool built() {
  return false;
}

BlockTensor quantize(const at::Tensor&, const BlockFormat&,
                     const c10::optional<StochasticRounding>&, const c10::optional<float>&) {
  none();
}

at::Tensor block_values(const BlockTensor&, const DecodeTable&) {
  none();
}

at::Tensor hadamard16(const at::Tensor&, bool, bool) {
  none();
}

}  // namespace cuda_block
}  // namespace detail
}  // namespace fp8
}  // namespace ampx

#endif
