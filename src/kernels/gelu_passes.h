#pragma once

// ampx::mixed_gelu's two passes over whole tensors (src-internal), shared
// with the wide products' fused GELU (ampx::wide_gelu_linear), which runs
// them block by block: each element goes through the span kernel's same
// vector math wherever a block starts (the kernels pad their tails to whole
// vectors), so a block's GELU is bit for bit that of the whole tensor.
//
//   gelu_pass(x, y, isa);                 // y = GELU(x)
//   gelu_backward_pass(dy, x, dx, isa);   // dx = dy * GELU'(x)

#include "ampx/detail/cpu_isa.h"

#include <ATen/core/Tensor.h>

namespace ampx {
namespace detail {
namespace cpu {

/// y = GELU(x), float32 math, one rounding: x and y contiguous bfloat16 or
/// float16 CPU tensors of one dtype and numel; split across threads.
void gelu_pass(const at::Tensor& x, const at::Tensor& y, Isa isa);
/// dx = dy * (Phi(x) + x * phi(x)), likewise, every tensor of x's dtype.
void gelu_backward_pass(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dx, Isa isa);

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
