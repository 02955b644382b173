#pragma once

// The span kernels of ampx's mixed-precision GELU (activation_span.cpp), one
// per instruction set like the other span kernels (see unscale_kernels.h):
// 16-bit (bfloat16 or float16) spans in and out, the math in float32 with
// the intermediates never rounded, one rounding per output element.

#include "isa_dispatch.h"

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace ampx {
namespace detail {
namespace cpu {

#define AMPX_DECLARE_ISA_KERNELS(ns)                                                      \
  namespace ns {                                                                          \
  /* y[0, n) = x * 0.5 * (1 + erf(x / sqrt(2))): exact GELU, x and y of `dtype`. */       \
  void gelu_span(const void* x, c10::ScalarType dtype, void* y, int64_t n);               \
  /* dx[0, n) = dy * (Phi(x) + x * phi(x)), every tensor of `dtype`. */                   \
  void gelu_backward_span(const void* dy, const void* x, c10::ScalarType dtype, void* dx, \
                          int64_t n);                                                     \
  }
AMPX_DECLARE_ISA_KERNELS(DEFAULT)
AMPX_DECLARE_ISA_KERNELS(AVX2)
AMPX_DECLARE_ISA_KERNELS(AVX512)
#undef AMPX_DECLARE_ISA_KERNELS

/// The GELU kernels of one ISA.
struct GeluKernels {
  void (*forward)(const void*, c10::ScalarType, void*, int64_t);
  void (*backward)(const void*, const void*, c10::ScalarType, void*, int64_t);
};

#define AMPX_GELU_BUILD(ns)                 \
  GeluKernels {                             \
    &ns::gelu_span, &ns::gelu_backward_span \
  }
AMPX_ISA_DISPATCH(GeluKernels, gelu_kernels_for, AMPX_GELU_BUILD)
#undef AMPX_GELU_BUILD

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
