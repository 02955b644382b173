#include "ampx/fp8/linear.h"

#include "ampx/autocast.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>

#include <cmath>

namespace ampx {
namespace fp8 {
namespace {

thread_local bool t_fp8_enabled = false;

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// y = dq(q8(x)) @ dq(q8(w))^T + b in float32; the states' scales are those
// of the steps before (delayed scaling), the amaxes seen here feed the next.
struct Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, int64_t module, int64_t out_dtype) {
    auto* m = reinterpret_cast<LinearImpl*>(module);
    // The products are FP8 emulation in float32: autocast must not recast them.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    auto& in = m->input_state();
    auto& ws = m->weight_state();
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    const at::Tensor x_scale_inv = in.scale_inv().clone();
    const at::Tensor w_scale_inv = ws.scale_inv().clone();
    const at::Tensor x_codes = quantize(x2, in.format(), in.scale());      // uint8 [N, in]
    const at::Tensor w_codes = quantize(weight, ws.format(), ws.scale());  // uint8 [out, in]
    in.update(compute_amax(x2));
    ws.update(compute_amax(weight));
    const at::Tensor xq = dequantize(x_codes, in.format(), x_scale_inv, at::kFloat);
    const at::Tensor wq = dequantize(w_codes, ws.format(), w_scale_inv, at::kFloat);
    at::Tensor y = at::mm(xq, wq.t());
    if (bias.defined()) y = y + bias.to(at::kFloat);
    ctx->save_for_backward({x_codes, w_codes, x_scale_inv, w_scale_inv});
    ctx->saved_data["module"] = module;
    ctx->saved_data["has_bias"] = bias.defined();
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    auto out_sizes = x.sizes().vec();
    out_sizes.back() = weight.size(0);
    return y.to(static_cast<c10::ScalarType>(out_dtype)).view(out_sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* m = reinterpret_cast<LinearImpl*>(ctx->saved_data["module"].toInt());
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const auto& x_codes = saved[0];
    const auto& w_codes = saved[1];
    auto& gs = m->grad_output_state();
    const at::Tensor g = grads[0].reshape({-1, w_codes.size(0)}).to(at::kFloat);
    const at::Tensor g_scale_inv = gs.scale_inv().clone();
    const at::Tensor g_codes = quantize(g, gs.format(), gs.scale());
    gs.update(compute_amax(g));
    const at::Tensor gq = dequantize(g_codes, gs.format(), g_scale_inv, at::kFloat);
    const at::Tensor xq = dequantize(x_codes, m->input_state().format(), saved[2], at::kFloat);
    const at::Tensor wq = dequantize(w_codes, m->weight_state().format(), saved[3], at::kFloat);
    const auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    const auto x_dtype = static_cast<c10::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    at::Tensor grad_x = gq.mm(wq).view(x_sizes).to(x_dtype);
    at::Tensor grad_w = gq.t().mm(xq);
    at::Tensor grad_b = ctx->saved_data["has_bias"].toBool() ? g.sum(0) : at::Tensor();
    return {grad_x, grad_w, grad_b, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

Fp8AutocastGuard::Fp8AutocastGuard(bool enabled) : previous_(t_fp8_enabled) {
  t_fp8_enabled = enabled;
}
Fp8AutocastGuard::~Fp8AutocastGuard() {
  t_fp8_enabled = previous_;
}

bool is_fp8_enabled() {
  return t_fp8_enabled;
}

LinearImpl::LinearImpl(const LinearOptions& options_) : options(options_) {
  reset();
}

void LinearImpl::reset() {
  TORCH_CHECK(options.in_features() > 0 && options.out_features() > 0,
              "ampx::fp8::Linear: in_features and out_features must be > 0, got ",
              options.in_features(), " and ", options.out_features());
  // FP8 tensor cores want multiples of 16; the emulation takes any size.
  weight =
      register_parameter("weight", torch::empty({options.out_features(), options.in_features()}));
  bias = options.bias() ? register_parameter("bias", torch::empty({options.out_features()}))
                        : register_parameter("bias", {}, /*requires_grad=*/false);
  // torch::nn::Linear's initialisation.
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(options.in_features()));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
  input_state_ = std::make_shared<DelayedScalingState>(options.recipe(), Pass::kForward);
  weight_state_ = std::make_shared<DelayedScalingState>(options.recipe(), Pass::kForward);
  grad_output_state_ = std::make_shared<DelayedScalingState>(options.recipe(), Pass::kBackward);
  // The states' tensors are the module's buffers (updated in place), so that
  // checkpoints and .to(device) carry them.
  auto add = [&](const char* role, DelayedScalingState& s) {
    register_buffer(std::string(role) + "_amax_history", s.amax_history());
    register_buffer(std::string(role) + "_scale", s.scale());
    register_buffer(std::string(role) + "_scale_inv", s.scale_inv());
  };
  add("input", *input_state_);
  add("weight", *weight_state_);
  add("grad_output", *grad_output_state_);
}

at::Tensor LinearImpl::forward(const at::Tensor& x) {
  if (!is_fp8_enabled()) return torch::nn::functional::linear(x, weight, bias);
  TORCH_CHECK(x.is_floating_point() && x.dim() >= 1 && x.size(-1) == options.in_features(),
              "ampx::fp8::Linear: input must be floating with last dimension ",
              options.in_features(), ", got ", x.scalar_type(), " ", x.sizes());
  c10::ScalarType out_dtype = at::kBFloat16;
  if (options.output_dtype()) {
    out_dtype = *options.output_dtype();
  } else if (is_autocast_enabled(x.device().type())) {
    out_dtype = get_autocast_dtype(x.device().type());
  }
  return Fp8LinearFunction::apply(x, weight, bias, reinterpret_cast<int64_t>(this),
                                  static_cast<int64_t>(out_dtype));
}

}  // namespace fp8
}  // namespace ampx
