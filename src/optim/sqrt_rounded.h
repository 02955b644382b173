#pragma once

// The per-tensor (generic) optimizer steps compute with ATen's ops; where an
// ATen kernel does not round as IEEE arithmetic does, they take the value
// from here, so that a param's update has the same bits on that path as in
// the fused CPU and CUDA kernels (src/optim/fused/optim_math.h), on every LibTorch.

#include <ATen/ATen.h>

namespace ampx {
namespace optim {
namespace detail {

/// sqrt(x), rounded once to x's dtype (float32 states), as the fused kernels'
/// vsqrt and CUDA's sqrtf are. PyTorch 2.15's wheel computes torch.sqrt of
/// float32 on the CPU 1 ulp off in about 17% of inputs (17014 of 100000 in
/// [0.01, 3), at every ATEN_CPU_CAPABILITY; Debian's builds round correctly),
/// which made AdamW's strided-param path drift from its fused one
/// (OptimTest.FusedCpuKernelsRoundAsThePerTensorPath on the wheel leg). In
/// float64, within an ulp of the exact root, and rounded to float32: an exact
/// float32 root lies at least 2^-50 (relative) from a float32 rounding
/// boundary, twice as far as a float64 ulp, so the rounding is the correct one.
inline at::Tensor sqrt_rounded_once(const at::Tensor& x) {
  return x.to(at::kDouble).sqrt().to(x.scalar_type());
}

}  // namespace detail
}  // namespace optim
}  // namespace ampx
