// The wide products a converted Linear may run instead of FP8 (a precision
// plan's fp32 and fp16 layers): float32, or float16 with each product's
// operand scaled per tensor by a power of two that keeps it within float16's
// range.

#include "linear_internal.h"

#include "../kernels/function_args.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <cmath>

namespace ampx {
namespace fp8 {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// a [M, K] . b [K, N] of float16 operands, accumulated in float32 and
// rounded to float16, as a float16 GEMM does; on CUDA that GEMM, elsewhere
// the float32 product of the same values.
at::Tensor half_product(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_cuda()) return at::mm(a, b);
  return at::mm(a.to(at::kFloat), b.to(at::kFloat)).to(at::kHalf);
}

at::Tensor amax_of(const at::Tensor& t) {
  return t.abs().max().to(at::kFloat).reshape({1});
}

// The power of two s that an operand A (the input in the forward, the
// output gradient G in the backward) is multiplied by before its float16
// rounding, for a product A . B that sums k terms: the largest that keeps
// both A's largest value and the product's worst case, k x amax(A) x
// amax(B), at most 2^15 (float16 holds 65504), so that neither overflows and
// A keeps the most of float16's range below; its exponent clamped to
// float32's normal range. 1 where an amax is not finite (the inf or NaN goes
// through). float32 [1] on A's device: no host wait.
at::Tensor product_scale(const at::Tensor& g_amax, const at::Tensor& other_amax, int64_t k) {
  // Exponents added, not amaxes multiplied: the product of two large ones
  // would overflow float32.
  const at::Tensor spread =
      at::clamp_min(at::log2(other_amax) + std::log2(static_cast<double>(k)), 0.0);
  const at::Tensor exponent = 15.0 - at::ceil(at::log2(g_amax)) - at::ceil(spread);
  const at::Tensor scale = at::exp2(at::clamp(exponent, -126.0, 126.0));
  const at::Tensor finite = at::isfinite(g_amax).logical_and(at::isfinite(other_amax));
  return at::where(finite, scale, at::ones_like(scale));
}

// The power of two that brings a weight's largest value into (0.5, 1]: its
// small values keep 2^24 of float16's range below it, whatever its size,
// and the input's scale (product_scale) has the rest of 2^15. Its exponent
// clamped to float32's normal range; 1 where the amax is not finite.
at::Tensor weight_scale(const at::Tensor& w_amax) {
  const at::Tensor exponent = at::clamp(-at::ceil(at::log2(w_amax)), -126.0, 126.0);
  return at::where(at::isfinite(w_amax), at::exp2(exponent), at::ones_like(w_amax));
}

// `t`'s rows: a matrix of its last dimension (one row for a vector); also
// where that dimension is 0, which reshape({-1, 0}) refuses.
at::Tensor rows_of(const at::Tensor& t) {
  return t.dim() == 1 ? t.unsqueeze(0) : t.flatten(0, -2);
}

struct HalfLinearFunction : public torch::autograd::Function<HalfLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias_arg) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor bias = ampx::detail::tensor_or_undefined(bias_arg);
    const at::Tensor x2 = rows_of(x);
    at::Tensor x16, w16, scale_x, scale_w, y;
    if (x2.numel() == 0 || weight.numel() == 0) {  // no rows, features or outputs
      x16 = x2.to(at::kHalf);
      w16 = weight.to(at::kHalf);
      scale_x = scale_w = at::ones({1}, x2.options().dtype(at::kFloat));
      y = at::zeros({x2.size(0), weight.size(0)}, x2.options().dtype(at::kFloat));
    } else {
      // Each operand scaled by a power of two before its float16 rounding,
      // so that neither it nor the product overflows float16 (an activation
      // of 1e5, or many terms of large ones, would be inf) and small values
      // keep the most of float16's range. (Powers of two: the values round
      // as unscaled ones do, but at the range's ends.)
      scale_w = weight_scale(amax_of(weight));
      w16 = (weight.to(at::kFloat) * scale_w).to(at::kHalf);
      scale_x = product_scale(amax_of(x2), amax_of(w16), x2.size(1));
      x16 = (x2.to(at::kFloat) * scale_x).to(at::kHalf);
      y = half_product(x16, w16.t()).to(at::kFloat) / scale_x / scale_w;
    }
    if (bias.defined()) y = y + bias.to(at::kFloat);  // the bias added in float32
    ctx->save_for_backward({x16, w16});
    ctx->saved_data["scale_x"] = scale_x;
    ctx->saved_data["scale_w"] = scale_w;
    detail::LinearShape::save(ctx, x, weight, bias);
    return detail::linear_output(y, x, weight.size(0));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x16 = saved[0];  // x x scale_x
    const at::Tensor& w16 = saved[1];  // weight x scale_w
    const at::Tensor scale_x = ctx->saved_data["scale_x"].toTensor();
    const at::Tensor scale_w = ctx->saved_data["scale_w"].toTensor();
    const at::Tensor g = rows_of(grads[0]).to(at::kFloat);
    const detail::LinearShape shape = detail::LinearShape::load(ctx);
    const auto& x_sizes = shape.x_sizes;
    const auto x_dtype = shape.x_dtype;
    const auto w_dtype = shape.w_dtype;
    const at::Tensor grad_b = shape.has_bias ? g.sum(0).to(w_dtype) : at::Tensor();
    if (g.numel() == 0 || x16.numel() == 0) {  // no rows (or no features): nothing to sum
      return {at::zeros(x_sizes, g.options().dtype(x_dtype)),
              at::zeros(w16.sizes(), g.options().dtype(w_dtype)), grad_b};
    }
    // A loss scale per product and per step, with no step to skip: G scaled
    // so that the product neither overflows float16 nor loses G's small
    // values (float16 keeps 2^-24 of G's largest below it), unscaled in
    // float32 with the other operand's scale (one division each: the two
    // scales' product may leave float32's range where the result does not).
    const at::Tensor g_amax = amax_of(g);
    const at::Tensor g_for_x = product_scale(g_amax, amax_of(w16), w16.size(0));
    const at::Tensor g_for_w = product_scale(g_amax, amax_of(x16), x16.size(0));
    const at::Tensor grad_x =
        (half_product((g * g_for_x).to(at::kHalf), w16).to(at::kFloat) / g_for_x / scale_w)
            .to(x_dtype)
            .view(x_sizes);
    const at::Tensor grad_w =
        (half_product((g * g_for_w).to(at::kHalf).t(), x16).to(at::kFloat) / g_for_w / scale_x)
            .to(w_dtype);
    return {grad_x, grad_w, grad_b};
  }
};

}  // namespace

namespace detail {

at::Tensor wide_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                       c10::ScalarType product) {
  TORCH_CHECK(x.is_floating_point() && x.dim() >= 1 && x.size(-1) == weight.size(1),
              "ampx::fp8: the input of a ", product == at::kHalf ? "float16" : "float32",
              " linear must be floating with last dimension ", weight.size(1), ", got ",
              x.scalar_type(), " ", x.sizes());
  if (product == at::kHalf) {
    return HalfLinearFunction::apply(x, weight, ampx::detail::optional_tensor(bias));
  }
  TORCH_CHECK(product == at::kFloat, "ampx::fp8: no wide product in ", product);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return at::linear(x.to(at::kFloat), weight.to(at::kFloat),
                    bias.defined() ? bias.to(at::kFloat) : bias);
}

}  // namespace detail
}  // namespace fp8
}  // namespace ampx
