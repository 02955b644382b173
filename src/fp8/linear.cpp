#include "ampx/fp8/linear.h"
#include "autocast_internal.h"
#include "block/block_internal.h"
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

// Each product takes its left operand row-major and its right one
// column-major, as at::_scaled_mm does; an operand's column-major form is
// the row-major codes of its transpose, which the CUDA cast writes in the
// same pass (TensorScaling::cast's `transposed`). The emulation multiplies
// the float32 values of the same codes.

std::atomic<int64_t> g_scaled_mm_calls{0};

/// One operand: codes [rows, cols] row-major, scale_inv, format.
using Operand = Fp8Tensor;

/// a [M, K] . b [K, N] where bt holds b's transpose row-major ([N, K]), in
/// `out_dtype`, plus `bias` (out_dtype, [N]) in the product's epilogue; on FP8
/// tensor cores. Undefined where the device or the shapes do not allow it
/// (the caller emulates then): PyTorch wants every dim % 16, no E5M2 x E5M2.
#if AMPX_HAS_SCALED_MM
at::Tensor scaled_mm(const Operand& a, const Operand& bt, const at::Tensor& bias,
                     c10::ScalarType out_dtype) {
  static std::atomic<bool> refused{false};
  if (!a.codes.is_cuda() || refused.load() || a.codes.size(0) % 16 || a.codes.size(1) % 16 ||
      bt.codes.size(0) % 16 || (a.format == Fp8Format::kE5M2 && bt.format == Fp8Format::kE5M2)) {
    return {};
  }
  try {
    const at::Tensor a8 = codes_to_torch_float8(a.codes, a.format);
    const at::Tensor b8 = codes_to_torch_float8(bt.codes, bt.format).t();  // column-major, no copy
    at::Tensor out = at::_scaled_mm(a8, b8, a.scale_inv.reshape({}), bt.scale_inv.reshape({}),
                                    bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt,
                                    c10::nullopt, out_dtype, /*use_fast_accum=*/false);
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
at::Tensor scaled_mm(const Operand&, const Operand&, const at::Tensor&, c10::ScalarType) {
  return {};
}
#endif

/// The bias the product's epilogue can add: _scaled_mm takes a 16-bit bias
/// of the output's dtype only; another is added after, in float32, as the
/// emulation adds it.
at::Tensor epilogue_bias(const at::Tensor& bias, c10::ScalarType out_dtype) {
  const bool fits = bias.defined() && bias.scalar_type() == out_dtype && out_dtype != at::kFloat;
  return fits ? bias : at::Tensor();
}

/// The product on tensor cores, or its float32 emulation `emulated()`, in
/// `out_dtype`, plus `bias` (added in float32 before the rounding to
/// out_dtype where the epilogue cannot).
template <class Emulated>
at::Tensor product(const Operand& a, const Operand& bt, const at::Tensor& bias,
                   c10::ScalarType out_dtype, Emulated emulated) {
  const at::Tensor in_epilogue = epilogue_bias(bias, out_dtype);
  at::Tensor y = scaled_mm(a, bt, in_epilogue, in_epilogue.defined() ? out_dtype : at::kFloat);
  if (!y.defined()) y = emulated();
  if (in_epilogue.defined() && y.scalar_type() == out_dtype) return y;
  if (bias.defined()) y = y + bias.to(at::kFloat);
  return y.to(out_dtype);
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
// On CUDA each cast writes its codes and their transpose in one pass, and
// the backward keeps the transposes only: the input gradient takes w's
// (w [out, in] column-major is w^T row-major), the weight gradient x's.
struct Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
  // bias as an optional (kernels/function_args.h).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias_arg,
                            std::shared_ptr<LinearScaling> scaling,
                            c10::ScalarType out_dtype, const dist::ProcessGroup* group,
                            bool record, WeightCasts weight_casts) {
    // The products are FP8 in float32: autocast must not recast them.
    const at::Tensor bias = ampx::detail::tensor_or_undefined(bias_arg);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    at::Tensor x_t, w_t;  // defined by CUDA casts only
    const Operand xc = scaling->input->cast(x2, record, group, &x_t);
    const Operand wc = scaling->weight->cast_weight(weight, weight_casts, record, group, &w_t);
    const at::Tensor y = product(xc, wc, bias, out_dtype, [&] {
      return at::mm(xc.dequantize(), wc.dequantize().t());
    });
    const bool transposed = x_t.defined() && w_t.defined();
    ctx->save_for_backward({transposed ? x_t : xc.codes, transposed ? w_t : wc.codes,
                            xc.scale_inv, wc.scale_inv});
    ctx->saved_data["transposed"] = transposed;
    ctx->saved_data["scaling"] =
        c10::IValue::make_capsule(c10::make_intrusive<ScalingHolder>(scaling));
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    detail::LinearShape::save(ctx, x, weight, bias);
    return detail::linear_output(y, x, weight.size(0));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto scaling =
        static_cast<ScalingHolder*>(ctx->saved_data["scaling"].toCapsule().get())->scaling;
    const auto* group =
        reinterpret_cast<const dist::ProcessGroup*>(ctx->saved_data["group"].toInt());
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const detail::BackwardCasts backward_casts;  // CUDA updates at the backward's end
    const auto saved = ctx->get_saved_variables();
    const bool transposed = ctx->saved_data["transposed"].toBool();
    // x and w as saved: their transposes' codes on CUDA, their own elsewhere.
    const Operand xs{saved[0], saved[2], scaling->input->format()};
    const Operand ws{saved[1], saved[3], scaling->weight->format()};
    const int64_t out_features = transposed ? ws.codes.size(1) : ws.codes.size(0);
    const at::Tensor g = grads[0].reshape({-1, out_features});
    at::Tensor g_t;
    const Operand go = scaling->grad_output->cast(g, /*record=*/true, group, &g_t);
    const detail::LinearShape shape = detail::LinearShape::load(ctx);
    const auto& x_sizes = shape.x_sizes;
    const auto x_dtype = shape.x_dtype;
    const auto w_dtype = shape.w_dtype;
    at::Tensor grad_x, grad_w;
    if (transposed) {
      TORCH_INTERNAL_ASSERT(g_t.defined(), "ampx::fp8: the output gradient's cast gave no transpose");
      // Each product's right operand column-major: its transpose's rows.
      // grad_x [N, in] = g [N, out] . w [out, in], w^T's rows saved;
      grad_x = product(go, ws, {}, x_dtype, [&] {
        return at::mm(go.dequantize(), ws.dequantize().t());
      });
      // grad_w [out, in] = g^T [out, N] . x [N, in], x^T's rows saved.
      const Operand gt{g_t, go.scale_inv, go.format};
      grad_w = product(gt, xs, {}, w_dtype, [&] {
        return at::mm(gt.dequantize(), xs.dequantize().t());
      });
    } else {
      grad_x = at::mm(go.dequantize(), ws.dequantize()).to(x_dtype);
      grad_w = go.dequantize().t().mm(xs.dequantize()).to(w_dtype);
    }
    grad_x = grad_x.view(x_sizes);
    at::Tensor grad_b =
        shape.has_bias ? g.to(at::kFloat).sum(0).to(w_dtype) : at::Tensor();
    return {grad_x,       grad_w,       grad_b,       at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
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
  if (!is_fp8_enabled()) {
    TORCH_CHECK(!is_weight_stand_in(weight),
                "ampx::fp8::Linear: its weight was gathered as FP8 codes for an FP8 region "
                "(FullyShardedDataParallel's fp8_all_gather), but the layer runs outside one: keep "
                "FP8 on, or off, for the whole of a unit's forward");
    return torch::nn::functional::linear(x, weight, bias);
  }
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

void LinearShape::save(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& bias) {
  ctx->saved_data["has_bias"] = bias.defined();
  ctx->saved_data["x_sizes"] = x.sizes().vec();
  ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
  ctx->saved_data["w_dtype"] = static_cast<int64_t>(weight.scalar_type());
}

LinearShape LinearShape::load(AutogradContext* ctx) {
  LinearShape s;
  s.has_bias = ctx->saved_data["has_bias"].toBool();
  s.x_sizes = ctx->saved_data["x_sizes"].toIntVector();
  s.x_dtype = static_cast<c10::ScalarType>(ctx->saved_data["x_dtype"].toInt());
  s.w_dtype = static_cast<c10::ScalarType>(ctx->saved_data["w_dtype"].toInt());
  return s;
}

at::Tensor linear_output(const at::Tensor& y, const at::Tensor& x, int64_t out_features) {
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  return at::_unsafe_view(y, sizes);
}

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
                                  output_dtype_for(x, output_dtype), region_group(), record,
                                  region_weight_casts());
}

}  // namespace detail

}  // namespace fp8
}  // namespace ampx
