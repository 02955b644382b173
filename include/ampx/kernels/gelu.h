#pragma once

/// \file
/// GELU of a 16-bit input with float32 math, fused on the CPU, forward and
/// backward; O2 runs bf16/fp16 GELUs on the CPU through it.
///
/// ```
///   auto x = torch::randn({4, 1024}).to(torch::kBFloat16);
///   auto y = ampx::mixed_gelu(x);   // at::gelu(x.float()).to(x.dtype()), within one bf16 ulp
///   y.scalar_type();                // BFloat16
///   ampx::mixed_gelu_is_fused(x);   // true: the CPU kernel
/// ```

#include <ATen/core/Tensor.h>

namespace ampx {

/// Exact GELU (`approximate="none"`) of a 16-bit input with the math in
/// float32, returned in x's dtype: `at::gelu(x.float()).to(x.dtype())`
/// forward and backward (dx = dy * (Phi(x) + x * phi(x)), rounded once to
/// x's dtype), within one 16-bit ulp of float64, saving the 16-bit input. On
/// the CPU in one vectorized pass each way (erf by a polynomial sharing its
/// exp with the normal density); other devices run that composite, float32
/// and float64 inputs plain at::gelu. O2 (KeepNormsFp32Guard) runs bf16/fp16
/// GELUs on the CPU through it: LibTorch 1.13's bf16 GELU backward is
/// several times slower (docs/performance-notes.md).
at::Tensor mixed_gelu(const at::Tensor& x);

/// Whether mixed_gelu runs the fused CPU kernel for x (CPU, bfloat16 or
/// float16, at least one element).
bool mixed_gelu_is_fused(const at::Tensor& x);

}  // namespace ampx
