// ampx::mixed_layer_norm: LayerNorm of bfloat16/float16 activations with
// float32 statistics and affine parameters, in one pass over the rows forward
// and one backward (kernels/isa/norm_span.cpp), saving the 16-bit input for
// backward. What O2's fp32 norms compute, without the float32 copies around
// them.

#include "ampx/kernels/mixed_norms.h"

#include "function_args.h"
#include "isa/norm_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <algorithm>
#include <vector>

namespace ampx {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows per parallel task: about 16k elements of work.
int64_t row_grain(int64_t n) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n));
}

const float* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<float>() : nullptr;
}

struct MixedLayerNormFunction : public torch::autograd::Function<MixedLayerNormFunction> {
  // weight and bias as optionals (function_args.h).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const c10::optional<at::Tensor>& weight_arg,
                            const c10::optional<at::Tensor>& bias_arg, int64_t n,
                            int64_t normalized_dims, double eps) {
    const at::Tensor weight = ampx::detail::tensor_or_undefined(weight_arg);
    const at::Tensor bias = ampx::detail::tensor_or_undefined(bias_arg);
    const at::Tensor xc = x.contiguous();
    const at::Tensor w = weight.defined() ? weight.contiguous() : weight;
    const at::Tensor b = bias.defined() ? bias.contiguous() : bias;
    const int64_t m = n == 0 ? 0 : xc.numel() / n;
    at::Tensor y = at::empty_like(xc);
    at::Tensor mean = at::empty({m}, xc.options().dtype(at::kFloat));
    at::Tensor rstd = at::empty({m}, xc.options().dtype(at::kFloat));
    const auto rows = detail::cpu::layer_norm_rows_for(detail::cpu::best_isa());
    const void* xp = xc.data_ptr();
    void* yp = y.data_ptr();
    float* mp = mean.data_ptr<float>();
    float* rp = rstd.data_ptr<float>();
    const float* wp = data_or_null(w);
    const float* bp = data_or_null(b);
    const auto dtype = xc.scalar_type();
    at::parallel_for(0, m, row_grain(n), [&](int64_t r0, int64_t r1) {
      rows(xp, dtype, wp, bp, yp, mp, rp, r0, r1, n, static_cast<float>(eps));
    });
    ctx->save_for_backward({xc, w, mean, rstd});
    ctx->saved_data["n"] = n;
    ctx->saved_data["shape"] = x.sizes().slice(x.dim() - normalized_dims).vec();
    ctx->saved_data["has_bias"] = bias.defined();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor& mean = saved[2];
    const at::Tensor& rstd = saved[3];
    const int64_t n = ctx->saved_data["n"].toInt();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const at::Tensor dy = grads[0].to(x.scalar_type()).contiguous();
    const int64_t m = mean.numel();
    at::Tensor dx = at::empty_like(x);
    const bool want_w = w.defined() && w.requires_grad();
    const bool want_b = has_bias;
    // dw and db: one float32 partial per fixed block of rows (the blocks
    // depend on the shape only, never on the thread count), summed in
    // block order: the same bits on any number of threads.
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(m, 64));
    const int64_t per_block = (m + blocks - 1) / blocks;
    at::Tensor partial_w, partial_b;
    if (want_w) partial_w = at::zeros({blocks, n}, x.options().dtype(at::kFloat));
    if (want_b) partial_b = at::zeros({blocks, n}, x.options().dtype(at::kFloat));
    const auto rows = detail::cpu::layer_norm_backward_rows_for(detail::cpu::best_isa());
    const void* dyp = dy.data_ptr();
    const void* xp = x.data_ptr();
    void* dxp = dx.data_ptr();
    const float* mp = mean.data_ptr<float>();
    const float* rp = rstd.data_ptr<float>();
    const float* wp = data_or_null(w);
    float* pw = want_w ? partial_w.data_ptr<float>() : nullptr;
    float* pb = want_b ? partial_b.data_ptr<float>() : nullptr;
    const auto dtype = x.scalar_type();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t r0 = std::min(m, blk * per_block), r1 = std::min(m, r0 + per_block);
        rows(dyp, xp, dtype, mp, rp, wp, dxp, pw ? pw + blk * n : nullptr,
             pb ? pb + blk * n : nullptr, r0, r1, n);
      }
    });
    const auto shape = ctx->saved_data["shape"].toIntVector();
    at::Tensor dw = want_w ? partial_w.sum(0).view(shape) : at::Tensor();
    at::Tensor db = want_b ? partial_b.sum(0).view(shape) : at::Tensor();
    return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool mixed_layer_norm_is_fused(const at::Tensor& x, at::IntArrayRef normalized_shape,
                               const at::Tensor& weight, const at::Tensor& bias) {
  auto fp32_param = [&](const at::Tensor& p) {
    return !p.defined() ||
           (p.device().is_cpu() && p.scalar_type() == at::kFloat && p.sizes() == normalized_shape);
  };
  const auto d = static_cast<int64_t>(normalized_shape.size());
  return x.device().is_cpu() &&
         (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) && d >= 1 &&
         x.dim() >= d && x.sizes().slice(x.dim() - d) == normalized_shape && fp32_param(weight) &&
         fp32_param(bias) && x.numel() > 0;
}

at::Tensor mixed_layer_norm(const at::Tensor& x, at::IntArrayRef normalized_shape,
                            const at::Tensor& weight, const at::Tensor& bias, double eps) {
  if (!mixed_layer_norm_is_fused(x, normalized_shape, weight, bias)) {
    // The same math in ATen's ops: float32 norm, output in x's dtype.
    auto f32 = [](const at::Tensor& t) { return t.defined() ? t.to(at::kFloat) : t; };
    return at::layer_norm(f32(x), normalized_shape, f32(weight), f32(bias), eps)
        .to(x.scalar_type());
  }
  int64_t n = 1;
  for (auto s : normalized_shape) n *= s;
  return MixedLayerNormFunction::apply(x, ampx::detail::optional_tensor(weight),
                                       ampx::detail::optional_tensor(bias), n,
                                       static_cast<int64_t>(normalized_shape.size()), eps);
}

}  // namespace ampx
