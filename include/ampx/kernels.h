#pragma once

/// \file
/// The kernels ampx's mixed precision runs, usable on their own, one header
/// each under ampx/kernels/: this header includes them all.
///
/// - ampx/kernels/loss_scale.h: dynamic loss scaling's two kernels,
///   non_finite_check_and_unscale_ and update_scale_ (what GradScaler runs).
/// - ampx/kernels/mixed_norms.h: LayerNorm and batch norm of 16-bit inputs
///   with float32 statistics (mixed_layer_norm, mixed_batch_norm).
/// - ampx/kernels/gelu.h: GELU of 16-bit inputs in float32 (mixed_gelu).
/// - ampx/kernels/attention.h: scaled_dot_product_attention, fused on the CPU.
/// - ampx/kernels/pooling.h: max_pool2d over non-overlapping windows of an
///   NCHW CPU tensor, LibTorch's bit for bit.
/// - ampx/kernels/cpu_products.h: 16-bit CPU matrix products through the
///   float32 BLAS (CpuProducts, wide_linear, wide_bmm, wide_matmul).
///
/// ```
///   #include <ampx/kernels.h>
///   auto y = ampx::mixed_gelu(x);   // x bfloat16: y bfloat16, the math in float32
/// ```

#include "ampx/kernels/attention.h"
#include "ampx/kernels/cpu_products.h"
#include "ampx/kernels/gelu.h"
#include "ampx/kernels/loss_scale.h"
#include "ampx/kernels/mixed_norms.h"
#include "ampx/kernels/pooling.h"
