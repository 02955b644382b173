#pragma once

/// \file
/// The float32 norms of mixed precision over 16-bit inputs: LayerNorm and
/// batch norm with float32 statistics, weight and bias, returned in the
/// input's bfloat16/float16 dtype, fused on the CPU and saving the 16-bit
/// input (not a float32 copy) for backward. O2's norm layers run them
/// (CastPolicy::kFp32OutputsAsInput on aten::layer_norm and aten::batch_norm).
///
/// ```
///   auto x = torch::randn({8, 512}).to(torch::kBFloat16);
///   torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({512}));  // float32 weight, bias
///   auto y = ampx::mixed_layer_norm(x, {512}, ln->weight, ln->bias);
///   y.scalar_type();                                              // BFloat16
///   ampx::mixed_layer_norm_is_fused(x, {512}, ln->weight, ln->bias);  // true: the CPU kernel
/// ```

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace ampx {

/// LayerNorm over the last `normalized_shape` dimensions of a 16-bit input
/// with float32 statistics and float32 weight and bias, returned in x's
/// dtype: what `at::layer_norm(x.float(), ...).to(x.dtype())` computes (the
/// float32 norm of O2 and of autocast's fp32 policy), in one pass over the
/// rows forward and one backward on the CPU, saving the 16-bit input (not a
/// float32 copy) for backward. The gradients: dx in x's dtype, dweight and
/// dbias float32, summed in a fixed order (the same bits on any thread
/// count). Other devices and dtypes run the composite above. O2's norms use
/// it (CastPolicy::kFp32OutputsAsInput on aten::layer_norm); under O1,
/// `set_cast_policy("aten::layer_norm", CastPolicy::kFp32OutputsAsInput)`
/// makes autocast use it too.
at::Tensor mixed_layer_norm(const at::Tensor& x, at::IntArrayRef normalized_shape,
                            const at::Tensor& weight, const at::Tensor& bias, double eps = 1e-5);

/// Whether mixed_layer_norm runs the fused CPU kernel for these arguments
/// (CPU, bfloat16 or float16 x whose trailing sizes are normalized_shape,
/// float32 or undefined weight and bias of that shape, at least one element).
bool mixed_layer_norm_is_fused(const at::Tensor& x, at::IntArrayRef normalized_shape,
                               const at::Tensor& weight, const at::Tensor& bias);

/// Batch norm of a 16-bit input [N, C, *] with float32 statistics, weight,
/// bias and running statistics (updated in place when training, as
/// at::batch_norm does: momentum, unbiased running variance), returned in x's
/// dtype: what `at::batch_norm(x.float(), ...).to(x.dtype())` computes (O2's
/// fp32 batch norm), channel by channel in passes over the 16-bit input on
/// the CPU, saving the 16-bit input for backward (dx in x's dtype, dweight
/// and dbias float32). Other devices and dtypes run that composite. O2's
/// norms use it (kFp32OutputsAsInput on aten::batch_norm).
at::Tensor mixed_batch_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            const at::Tensor& running_mean, const at::Tensor& running_var,
                            bool training, double momentum = 0.1, double eps = 1e-5);

/// Whether mixed_batch_norm runs the fused CPU kernel for these arguments
/// (CPU, bfloat16 or float16 x with at least 2 dimensions, float32 or
/// undefined contiguous [C] weight, bias and running statistics, the running
/// statistics defined when not training).
bool mixed_batch_norm_is_fused(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, const at::Tensor& running_mean,
                               const at::Tensor& running_var, bool training);

}  // namespace ampx
