#include "ampx/fp8/linear.h"
#include "autocast_internal.h"
#include "block_internal.h"
#include "linear_internal.h"

#include "../kernels/function_args.h"
#include "ampx/autocast.h"
#include "ampx/detail/compat.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>

#include <atomic>
#include <cmath>

namespace ampx {
namespace fp8 {
namespace {

// ---- the matrix products ---------------------------------------------------

// The operands are Fp8Tensors (codes, scale_inv, format); the emulation
// multiplies their float32 values.

std::atomic<int64_t> g_scaled_mm_calls{0};

#if AMPX_HAS_SCALED_MM
// a [M, K] times b [N, K] transposed on FP8 tensor cores, float32 result;
// undefined where the device or the shapes do not allow it (then the caller
// emulates). PyTorch wants a row-major, b^T column-major, every dim % 16.
at::Tensor scaled_mm_nt(const Fp8Tensor& a, const Fp8Tensor& b) {
  static std::atomic<bool> refused{false};
  if (!a.codes.is_cuda() || refused.load() || a.codes.size(0) % 16 || a.codes.size(1) % 16 ||
      b.codes.size(0) % 16 || (a.format == Fp8Format::kE5M2 && b.format == Fp8Format::kE5M2)) {
    return {};
  }
  try {
    const at::Tensor a8 = codes_to_torch_float8(a.codes.contiguous(), a.format);
    const at::Tensor b8 = codes_to_torch_float8(b.codes.contiguous(), b.format).t();
    at::Tensor out = at::_scaled_mm(a8, b8, a.scale_inv.reshape({}), b.scale_inv.reshape({}),
                                    c10::nullopt, c10::nullopt, at::kFloat,
                                    /*use_fast_accum=*/false);
    g_scaled_mm_calls.fetch_add(1);
    return out;
  } catch (const c10::Error& e) {
    // Not Hopper/Ada, or a build without the kernel: emulate from now on.
    TORCH_WARN_ONCE("ampx::fp8: at::_scaled_mm is not available on ", a.codes.device(), " (",
                    e.what_without_backtrace(), "); FP8 products are emulated in float32");
    refused.store(true);
    return {};
  }
}
#else
at::Tensor scaled_mm_nt(const Fp8Tensor&, const Fp8Tensor&) {
  return {};
}
#endif

// y [N, out] = x [N, in] . w [out, in]^T
at::Tensor forward_product(const Fp8Tensor& x, const Fp8Tensor& w) {
  at::Tensor y = scaled_mm_nt(x, w);
  return y.defined() ? y : at::mm(x.dequantize(), w.dequantize().t());
}

// grad_x [N, in] = g [N, out] . w [out, in]
at::Tensor input_grad_product(const Fp8Tensor& g, const Fp8Tensor& w) {
  at::Tensor y;
  if (g.codes.is_cuda()) y = scaled_mm_nt(g, {w.codes.t().contiguous(), w.scale_inv, w.format});
  return y.defined() ? y : at::mm(g.dequantize(), w.dequantize());
}

// grad_w [out, in] = g [N, out]^T . x [N, in]
at::Tensor weight_grad_product(const Fp8Tensor& g, const Fp8Tensor& x) {
  at::Tensor y;
  if (g.codes.is_cuda()) {
    y = scaled_mm_nt({g.codes.t().contiguous(), g.scale_inv, g.format},
                     {x.codes.t().contiguous(), x.scale_inv, x.format});
  }
  return y.defined() ? y : g.dequantize().t().mm(x.dequantize());
}

// ---- the autograd function ---------------------------------------------------

struct ScalingHolder : torch::CustomClassHolder {
  explicit ScalingHolder(std::shared_ptr<LinearScaling> s) : scaling(std::move(s)) {}
  std::shared_ptr<LinearScaling> scaling;
};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// y = dq(q8(x)) @ dq(q8(w))^T + b in float32; the states' scales are those
// of the steps before (delayed scaling), the amaxes seen here feed the next.
struct Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
  // bias as an optional (kernels/function_args.h).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias_arg,
                            std::shared_ptr<LinearScaling> scaling,
                            c10::ScalarType out_dtype, const dist::ProcessGroup* group,
                            bool record) {
    // The products are FP8 in float32: autocast must not recast them.
    const at::Tensor bias = ampx::detail::tensor_or_undefined(bias_arg);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    const Fp8Tensor xc = scaling->input->cast(x2, record, group);
    const Fp8Tensor wc = scaling->weight->cast(weight, record, group);
    at::Tensor y = forward_product(xc, wc);
    if (bias.defined()) y = y + bias.to(at::kFloat);
    ctx->save_for_backward({xc.codes, wc.codes, xc.scale_inv, wc.scale_inv});
    ctx->saved_data["scaling"] =
        c10::IValue::make_capsule(c10::make_intrusive<ScalingHolder>(scaling));
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    ctx->saved_data["has_bias"] = bias.defined();
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(weight.scalar_type());
    auto out_sizes = x.sizes().vec();
    out_sizes.back() = weight.size(0);
    return y.to(out_dtype).view(out_sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto scaling =
        static_cast<ScalingHolder*>(ctx->saved_data["scaling"].toCapsule().get())->scaling;
    const auto* group =
        reinterpret_cast<const dist::ProcessGroup*>(ctx->saved_data["group"].toInt());
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const Fp8Tensor xo{saved[0], saved[2], scaling->input->format()};
    const Fp8Tensor wo{saved[1], saved[3], scaling->weight->format()};
    const at::Tensor g = grads[0].reshape({-1, wo.codes.size(0)}).to(at::kFloat);
    const Fp8Tensor go = scaling->grad_output->cast(g, /*record=*/true, group);
    const auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    const auto x_dtype = static_cast<c10::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const auto w_dtype = static_cast<c10::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    at::Tensor grad_x = input_grad_product(go, wo).view(x_sizes).to(x_dtype);
    at::Tensor grad_w = weight_grad_product(go, xo).to(w_dtype);
    at::Tensor grad_b = ctx->saved_data["has_bias"].toBool() ? g.sum(0).to(w_dtype) : at::Tensor();
    return {grad_x, grad_w, grad_b, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

c10::ScalarType output_dtype_for(const at::Tensor& x,
                                 const c10::optional<c10::ScalarType>& output_dtype) {
  if (output_dtype) return *output_dtype;
  if (is_autocast_enabled(x.device().type())) return get_autocast_dtype(x.device().type());
  return at::kBFloat16;
}

}  // namespace

// ---- ampx::fp8::Linear ---------------------------------------------------------------

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
  scaling_ = std::make_shared<LinearScaling>(options.recipe(), weight.device(), weight);
  // The states' tensors are the module's buffers (updated in place), so that
  // checkpoints and .to(device) carry them.
  scaling_->register_buffers(*this, "");
}

at::Tensor LinearImpl::forward(const at::Tensor& x) {
  if (!is_fp8_enabled()) return torch::nn::functional::linear(x, weight, bias);
  TORCH_CHECK(x.is_floating_point() && x.dim() >= 1 && x.size(-1) == options.in_features(),
              "ampx::fp8::Linear: input must be floating with last dimension ",
              options.in_features(), ", got ", x.scalar_type(), " ", x.sizes());
  return detail::fp8_linear(x, weight, bias, scaling_, options.output_dtype());
}

namespace {
TensorScaling& tensor_role(const std::shared_ptr<TensorScaling>& role, const Recipe& recipe) {
  TORCH_CHECK(role, "ampx::fp8::Linear: ", recipe.to_string(),
              " scales blocks: the layer has no delayed-scaling states");
  return *role;
}
}  // namespace

DelayedScalingState& LinearImpl::input_state() {
  return tensor_role(scaling_->input, scaling_->recipe).delayed_state();
}
DelayedScalingState& LinearImpl::weight_state() {
  return tensor_role(scaling_->weight, scaling_->recipe).delayed_state();
}
DelayedScalingState& LinearImpl::grad_output_state() {
  return tensor_role(scaling_->grad_output, scaling_->recipe).delayed_state();
}

namespace detail {

int64_t scaled_mm_calls() {
  return g_scaled_mm_calls.load();
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      const std::shared_ptr<LinearScaling>& scaling,
                      const c10::optional<c10::ScalarType>& output_dtype) {
  TORCH_CHECK(x.is_floating_point() && x.dim() >= 1 && x.size(-1) == weight.size(1),
              "ampx::fp8: the input of an FP8 linear must be floating with last dimension ",
              weight.size(1), ", got ", x.scalar_type(), " ", x.sizes());
  if (scaling->recipe.is_block()) {
    return block_linear(x, weight, bias, scaling, output_dtype_for(x, output_dtype));
  }
  // Inference (no grad) casts with the current scales and leaves them be.
  const bool record = at::GradMode::is_enabled();
  return Fp8LinearFunction::apply(x, weight, ampx::detail::optional_tensor(bias), scaling,
                                  output_dtype_for(x, output_dtype), region_group(), record);
}

}  // namespace detail

}  // namespace fp8
}  // namespace ampx
