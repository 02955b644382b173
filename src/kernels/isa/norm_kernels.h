#pragma once

// The row kernels of ampx's mixed-precision LayerNorm (norm_span.cpp), one
// per instruction set like the other span kernels (see unscale_kernels.h):
// 16-bit (bfloat16 or float16) rows in and out, statistics and affine
// parameters in float32, every row read once forward and once backward.

#include "isa_dispatch.h"

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace ampx {
namespace detail {
namespace cpu {

#define AMPX_DECLARE_ISA_KERNELS(ns)                                                         \
  namespace ns {                                                                             \
  /* Rows [r0, r1) of x (n columns, `dtype`): y = (x - mean) * rstd * w + b, mean and     \
     rstd (float32, one per row) written out. w, b: float32 [n] or null (1, 0). */         \
  void layer_norm_rows(const void* x, c10::ScalarType dtype, const float* w, const float* b,  \
                       void* y, float* mean, float* rstd, int64_t r0, int64_t r1, int64_t n, \
                       float eps);                                                           \
  /* Backward of rows [r0, r1): dx (x's dtype) from dy, x, mean, rstd and w; dw and db     \
     (float32 [n], may be null) accumulate this span's sums of dy * xhat and dy. */        \
  void layer_norm_backward_rows(const void* dy, const void* x, c10::ScalarType dtype,        \
                                const float* mean, const float* rstd, const float* w,        \
                                void* dx, float* dw, float* db, int64_t r0, int64_t r1,      \
                                int64_t n);                                                  \
  /* Batch norm, channel c of x [nb, channels, s] (`dtype`, contiguous): the float32 sum  \
     of its nb * s values, and the sum of squared deviations from `mean`. */              \
  double channel_sum(const void* x, c10::ScalarType dtype, int64_t nb, int64_t channels,    \
                     int64_t s, int64_t c);                                                  \
  double channel_sq_dev(const void* x, c10::ScalarType dtype, int64_t nb, int64_t channels, \
                        int64_t s, int64_t c, float mean);                                   \
  /* out = a * in + b over channel c (out, in of `dtype`). */                              \
  void channel_affine(const void* in, void* out, c10::ScalarType dtype, int64_t nb,         \
                      int64_t channels, int64_t s, int64_t c, float a, float b);             \
  /* Backward of channel c: sums of dy and of dy * (x - mean) (float32 lanes). */          \
  void channel_backward_sums(const void* dy, const void* x, c10::ScalarType dtype,          \
                             int64_t nb, int64_t channels, int64_t s, int64_t c, float mean, \
                             double* sum_dy, double* sum_dy_dev);                            \
  /* dx = k * dy + p * x + q over channel c. */                                            \
  void channel_backward_dx(const void* dy, const void* x, void* dx, c10::ScalarType dtype,  \
                           int64_t nb, int64_t channels, int64_t s, int64_t c, float k,      \
                           float p, float q);                                                \
  }
AMPX_DECLARE_ISA_KERNELS(DEFAULT)
AMPX_DECLARE_ISA_KERNELS(AVX2)
AMPX_DECLARE_ISA_KERNELS(AVX512)
#undef AMPX_DECLARE_ISA_KERNELS

using LayerNormRowsFn = void (*)(const void*, c10::ScalarType, const float*, const float*, void*,
                                 float*, float*, int64_t, int64_t, int64_t, float);
using LayerNormBackwardRowsFn = void (*)(const void*, const void*, c10::ScalarType, const float*,
                                         const float*, const float*, void*, float*, float*,
                                         int64_t, int64_t, int64_t);

/// The batch-norm channel kernels of one ISA.
struct BatchNormKernels {
  double (*channel_sum)(const void*, c10::ScalarType, int64_t, int64_t, int64_t, int64_t);
  double (*channel_sq_dev)(const void*, c10::ScalarType, int64_t, int64_t, int64_t, int64_t,
                           float);
  void (*channel_affine)(const void*, void*, c10::ScalarType, int64_t, int64_t, int64_t, int64_t,
                         float, float);
  void (*channel_backward_sums)(const void*, const void*, c10::ScalarType, int64_t, int64_t,
                                int64_t, int64_t, float, double*, double*);
  void (*channel_backward_dx)(const void*, const void*, void*, c10::ScalarType, int64_t, int64_t,
                              int64_t, int64_t, float, float, float);
};

#define AMPX_BATCH_NORM_BUILD(ns)                                                           \
  BatchNormKernels {                                                                        \
    &ns::channel_sum, &ns::channel_sq_dev, &ns::channel_affine, &ns::channel_backward_sums, \
        &ns::channel_backward_dx                                                            \
  }
AMPX_ISA_DISPATCH(BatchNormKernels, batch_norm_kernels_for, AMPX_BATCH_NORM_BUILD)
#undef AMPX_BATCH_NORM_BUILD

#define AMPX_LAYER_NORM_ROWS_BUILD(ns) &ns::layer_norm_rows
AMPX_ISA_DISPATCH(LayerNormRowsFn, layer_norm_rows_for, AMPX_LAYER_NORM_ROWS_BUILD)
#undef AMPX_LAYER_NORM_ROWS_BUILD

#define AMPX_LAYER_NORM_BACKWARD_ROWS_BUILD(ns) &ns::layer_norm_backward_rows
AMPX_ISA_DISPATCH(LayerNormBackwardRowsFn, layer_norm_backward_rows_for,
                  AMPX_LAYER_NORM_BACKWARD_ROWS_BUILD)
#undef AMPX_LAYER_NORM_BACKWARD_ROWS_BUILD

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
