// The wide products a converted Linear may run instead of FP8 (a precision
// plan's fp32 and fp16 layers): float32, or float16 with its output
// gradient scaled per tensor.

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

// a [M, K] . b [K, N] (+ bias [N]) of float16 operands, accumulated in
// float32 and rounded to float16, as a float16 GEMM does; on CUDA that GEMM,
// elsewhere the float32 product of the same values.
at::Tensor half_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias) {
  if (a.is_cuda()) return bias.defined() ? at::addmm(bias, a, b) : at::mm(a, b);
  const at::Tensor af = a.to(at::kFloat), bf = b.to(at::kFloat);
  const at::Tensor y = bias.defined() ? at::addmm(bias.to(at::kFloat), af, bf) : at::mm(af, bf);
  return y.to(at::kHalf);
}

at::Tensor amax_of(const at::Tensor& t) {
  return t.abs().max().to(at::kFloat).reshape({1});
}

// The power of two s that the output gradient G is multiplied by before its
// float16 rounding, for a product G . B that sums k terms: the largest that
// keeps both G's largest value and the product's worst case,
// k x amax(G) x amax(B), at most 2^15 (float16 holds 65504), so that neither
// overflows and G keeps the most of float16's range below; its exponent
// clamped to float32's normal range. 1 where an amax is not finite (the inf
// or NaN goes through). float32 [1] on G's device: no host wait.
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

struct HalfLinearFunction : public torch::autograd::Function<HalfLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias_arg) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor bias = ampx::detail::tensor_or_undefined(bias_arg);
    const at::Tensor x16 = x.reshape({-1, x.size(-1)}).to(at::kHalf);
    const at::Tensor w16 = weight.to(at::kHalf);
    const at::Tensor y =
        half_product(x16, w16.t(), bias.defined() ? bias.to(at::kHalf) : at::Tensor());
    ctx->save_for_backward({x16, w16});
    detail::LinearShape::save(ctx, x, weight, bias);
    // float32 holds the float16 values exactly, and every CPU op takes it.
    return detail::linear_output(y.to(at::kFloat), x, weight.size(0));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x16 = saved[0];
    const at::Tensor& w16 = saved[1];
    const at::Tensor g = grads[0].reshape({-1, w16.size(0)}).to(at::kFloat);
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
    // values (float16 keeps 2^-24 of G's largest below it), unscaled in float32.
    const at::Tensor g_amax = amax_of(g);
    const at::Tensor scale_x = product_scale(g_amax, amax_of(w16), w16.size(0));
    const at::Tensor scale_w = product_scale(g_amax, amax_of(x16), x16.size(0));
    const at::Tensor grad_x =
        (half_product((g * scale_x).to(at::kHalf), w16, {}).to(at::kFloat) / scale_x)
            .to(x_dtype)
            .view(x_sizes);
    const at::Tensor grad_w =
        (half_product((g * scale_w).to(at::kHalf).t(), x16, {}).to(at::kFloat) / scale_w)
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
