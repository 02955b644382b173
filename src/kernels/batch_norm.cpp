// ampx::mixed_batch_norm: batch norm of bfloat16/float16 activations with
// float32 statistics, affine parameters and running statistics (O2's fp32
// batch norm, mnist-cnn's), channel by channel in 16-bit passes over the
// input (kernels/isa/norm_span.cpp), saving the 16-bit input for backward.

#include "ampx/kernels/mixed_norms.h"

#include "function_args.h"
#include "isa/norm_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <cmath>
#include <vector>

namespace ampx {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Shape {
  int64_t nb, channels, s;
};
Shape shape_of(const at::Tensor& x) {
  const int64_t nb = x.size(0), channels = x.size(1);
  return {nb, channels, nb * channels == 0 ? 0 : x.numel() / (nb * channels)};
}

// Channels per parallel task: about 16k elements of work.
int64_t channel_grain(const Shape& sh) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, sh.nb * sh.s));
}

struct MixedBatchNormFunction : public torch::autograd::Function<MixedBatchNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const c10::optional<at::Tensor>& weight_arg,
                            const c10::optional<at::Tensor>& bias_arg,
                            const c10::optional<at::Tensor>& running_mean_arg,
                            const c10::optional<at::Tensor>& running_var_arg, bool training,
                            double momentum, double eps) {
    const at::Tensor xc = x.contiguous();
    const at::Tensor w = ampx::detail::tensor_or_undefined(weight_arg);
    const at::Tensor b = ampx::detail::tensor_or_undefined(bias_arg);
    at::Tensor rm = ampx::detail::tensor_or_undefined(running_mean_arg);
    at::Tensor rv = ampx::detail::tensor_or_undefined(running_var_arg);
    const Shape sh = shape_of(xc);
    const int64_t count = sh.nb * sh.s;
    TORCH_CHECK(!training || count > 1,
                "ampx::mixed_batch_norm: expected more than 1 value per channel when training, "
                "got input of size ",
                x.sizes());
    const auto k = detail::cpu::batch_norm_kernels_for(detail::cpu::best_isa());
    const auto dtype = xc.scalar_type();
    at::Tensor mean = at::empty({sh.channels}, xc.options().dtype(at::kFloat));
    at::Tensor invstd = at::empty({sh.channels}, xc.options().dtype(at::kFloat));
    at::Tensor y = at::empty_like(xc);
    float* mp = mean.data_ptr<float>();
    float* ip = invstd.data_ptr<float>();
    float* rmp = rm.defined() ? rm.data_ptr<float>() : nullptr;
    float* rvp = rv.defined() ? rv.data_ptr<float>() : nullptr;
    const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    const void* xp = xc.data_ptr();
    void* yp = y.data_ptr();
    const float mom = static_cast<float>(momentum);
    at::parallel_for(0, sh.channels, channel_grain(sh), [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        float m, istd;
        if (training) {
          m = static_cast<float>(k.channel_sum(xp, dtype, sh.nb, sh.channels, sh.s, c) / count);
          const double sq = k.channel_sq_dev(xp, dtype, sh.nb, sh.channels, sh.s, c, m);
          istd = static_cast<float>(1.0 / std::sqrt(sq / count + eps));
          if (rmp) rmp[c] = (1 - mom) * rmp[c] + mom * m;
          if (rvp) rvp[c] = (1 - mom) * rvp[c] + mom * static_cast<float>(sq / (count - 1));
        } else {
          m = rmp[c];
          istd = static_cast<float>(1.0 / std::sqrt(static_cast<double>(rvp[c]) + eps));
        }
        mp[c] = m;
        ip[c] = istd;
        const float a = istd * (wp ? wp[c] : 1.f);
        k.channel_affine(xp, yp, dtype, sh.nb, sh.channels, sh.s, c, a, (bp ? bp[c] : 0.f) - m * a);
      }
    });
    ctx->save_for_backward({xc, w, mean, invstd});
    ctx->saved_data["training"] = training;
    ctx->saved_data["has_bias"] = b.defined();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor& mean = saved[2];
    const at::Tensor& invstd = saved[3];
    const bool training = ctx->saved_data["training"].toBool();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const at::Tensor dy = grads[0].to(x.scalar_type()).contiguous();
    const Shape sh = shape_of(x);
    const double count = static_cast<double>(sh.nb * sh.s);
    const auto k = detail::cpu::batch_norm_kernels_for(detail::cpu::best_isa());
    const auto dtype = x.scalar_type();
    at::Tensor dx = at::empty_like(x);
    at::Tensor dw = at::empty({sh.channels}, x.options().dtype(at::kFloat));
    at::Tensor db = at::empty({sh.channels}, x.options().dtype(at::kFloat));
    const void* dyp = dy.data_ptr();
    const void* xp = x.data_ptr();
    void* dxp = dx.data_ptr();
    const float* mp = mean.data_ptr<float>();
    const float* ip = invstd.data_ptr<float>();
    const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
    float* dwp = dw.data_ptr<float>();
    float* dbp = db.data_ptr<float>();
    at::parallel_for(0, sh.channels, channel_grain(sh), [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        double sum_dy = 0, sum_dy_dev = 0;
        k.channel_backward_sums(dyp, xp, dtype, sh.nb, sh.channels, sh.s, c, mp[c], &sum_dy,
                                &sum_dy_dev);
        const double istd = ip[c];
        const double kk = istd * (wp ? wp[c] : 1.0);
        double p = 0, q = 0;
        if (training) {  // the batch statistics depend on x too
          p = -kk * istd * istd * sum_dy_dev / count;
          q = -kk * sum_dy / count - p * mp[c];
        }
        k.channel_backward_dx(dyp, xp, dxp, dtype, sh.nb, sh.channels, sh.s, c,
                              static_cast<float>(kk), static_cast<float>(p), static_cast<float>(q));
        dwp[c] = static_cast<float>(sum_dy_dev * istd);
        dbp[c] = static_cast<float>(sum_dy);
      }
    });
    return {dx,
            w.defined() && w.requires_grad() ? dw : at::Tensor(),
            has_bias ? db : at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

bool mixed_batch_norm_is_fused(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, const at::Tensor& running_mean,
                               const at::Tensor& running_var, bool training) {
  if (!x.device().is_cpu() || (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kHalf) ||
      x.dim() < 2 || x.numel() == 0) {
    return false;
  }
  const int64_t channels = x.size(1);
  auto fp32_vector = [&](const at::Tensor& p) {
    return !p.defined() || (p.device().is_cpu() && p.scalar_type() == at::kFloat && p.dim() == 1 &&
                            p.size(0) == channels && p.is_contiguous());
  };
  if (!training && (!running_mean.defined() || !running_var.defined())) return false;
  return fp32_vector(weight) && fp32_vector(bias) && fp32_vector(running_mean) &&
         fp32_vector(running_var);
}

at::Tensor mixed_batch_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            const at::Tensor& running_mean, const at::Tensor& running_var,
                            bool training, double momentum, double eps) {
  if (!mixed_batch_norm_is_fused(x, weight, bias, running_mean, running_var, training)) {
    // The same math in ATen's ops: float32 batch norm, output in x's dtype.
    auto f32 = [](const at::Tensor& t) { return t.defined() ? t.to(at::kFloat) : t; };
    return at::batch_norm(f32(x), f32(weight), f32(bias), running_mean, running_var, training,
                          momentum, eps, /*cudnn_enabled=*/true)
        .to(x.scalar_type());
  }
  return MixedBatchNormFunction::apply(
      x, ampx::detail::optional_tensor(weight), ampx::detail::optional_tensor(bias),
      ampx::detail::optional_tensor(running_mean), ampx::detail::optional_tensor(running_var),
      training, momentum, eps);
}

}  // namespace ampx
