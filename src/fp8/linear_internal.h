#pragma once

// The FP8 product both layer kinds run: ampx::fp8::Linear (linear.cpp) and a
// converted torch::nn::Linear (convert.cpp); the wide products a converted
// Linear may run instead (wide_linear.cpp).

#include "ampx/fp8/scaling.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <memory>
#include <vector>

namespace torch {
namespace autograd {
struct AutogradContext;
}  // namespace autograd
}  // namespace torch

namespace ampx {
namespace fp8 {
namespace detail {

/// y = FP8(x) @ FP8(weight)^T + bias with `scaling`, in `output_dtype` (unset:
/// the autocast dtype of x's device when autocast is on there, else
/// bfloat16); the autograd function both layer kinds run.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      const std::shared_ptr<LinearScaling>& scaling,
                      const c10::optional<c10::ScalarType>& output_dtype);

/// What the backward of each linear autograd Function (FP8, block-scaled,
/// wide) needs of its forward's arguments beside the operands it saves:
///
///   LinearShape::save(ctx, x, weight, bias);        // in forward
///   const LinearShape s = LinearShape::load(ctx);   // in backward
struct LinearShape {
  bool has_bias = false;
  std::vector<int64_t> x_sizes;
  c10::ScalarType x_dtype = c10::ScalarType::Float;
  c10::ScalarType w_dtype = c10::ScalarType::Float;
  /// Keeps them in ctx->saved_data.
  static void save(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                   const at::Tensor& weight, const at::Tensor& bias);
  /// What save() kept.
  static LinearShape load(torch::autograd::AutogradContext* ctx);
};

/// A linear Function's output: y [rows, out] shaped as x's leading
/// dimensions x out, not a view (autograd refuses in-place ops on a custom
/// Function's view outputs, and models add into a Linear's output, x += ...).
at::Tensor linear_output(const at::Tensor& y, const at::Tensor& x, int64_t out_features);

/// y = x @ weight^T + bias with a wide product (src/fp8/wide_linear.cpp),
/// autocast's casts left out: kFloat, float32 operands and output; kHalf,
/// float16 operands and product (float32 accumulation, rounded to float16):
/// the weight scaled by a power of two to a largest value in (0.5, 1], and
/// for each of the three products the other operand (the input, the output
/// gradient) by the largest power of two that keeps it and the product's
/// worst case (terms x amax x amax) within 2^15 before it is rounded to
/// float16; the product unscaled in float32, the bias added there.
at::Tensor wide_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                       c10::ScalarType product);

}  // namespace detail
}  // namespace fp8
}  // namespace ampx
