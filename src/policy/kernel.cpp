// The boxed kernel ampx registers on an op's Autocast key: cast the inputs on
// the stack per policy, then call the op again with the device's Autocast key
// excluded, as PyTorch's own autocast kernels do, so that the op and every op
// it calls run below autocast.

#include "registry.h"

#include "ampx/kernels.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>
#include <string>

namespace ampx {
namespace detail {
namespace {

// PyTorch's is_eligible: a defined floating tensor on the device, not float64.
bool eligible(const at::Tensor& t, c10::DeviceType device_type) {
  return t.defined() && t.is_floating_point() && t.device().type() == device_type &&
         t.scalar_type() != at::kDouble;
}

// Whether the kernel may replace argument `arg` by a cast copy: not if the op
// writes it (out=, in-place), nor batch norm's running statistics, which the
// op updates in place although their schema type is plain `Tensor?`.
bool castable(const c10::Argument& arg) {
  if (writes_argument(arg)) return false;
  return arg.name() != "running_mean" && arg.name() != "running_var";
}

template <class F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    // (by index: GCC 14+ take a reference to the list's element proxy for
    // a dangling one)
    const c10::List<at::Tensor> list = v.toTensorList();
    for (size_t j = 0; j < list.size(); ++j) f(list.get(j));
  } else if (v.isList()) {  // Tensor?[] (index, index_put)
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor()) f(e.toTensor());
    }
  }
}

// A copy of `v` with every tensor mapped by `f`; lists are copied, never
// changed in place (the caller may hold them).
template <class F>
c10::IValue map_tensors(const c10::IValue& v, F&& f) {
  if (v.isTensor()) return f(v.toTensor());
  if (v.isTensorList()) {
    auto list = v.toTensorList().copy();
    for (size_t i = 0; i < list.size(); ++i) list.set(i, f(list.get(i)));
    return list;
  }
  if (v.isList()) {
    auto list = v.toList().copy();
    for (size_t i = 0; i < list.size(); ++i) {
      c10::IValue e = list.get(i);
      if (e.isTensor()) list.set(i, f(e.toTensor()));
    }
    return list;
  }
  return v;
}

bool has_tensor(const c10::IValue& v) {
  return v.isTensor() || v.isTensorList() || v.isList();
}

// kFp32OutputsAsInput on aten::layer_norm(input, normalized_shape, weight?,
// bias?, eps, cudnn_enable) with a 16-bit CPU input: ampx's fused kernel,
// the same float32 math without the float32 copies. True if it ran.
bool fused_layer_norm(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (op.schema().name() != "aten::layer_norm" || !op.schema().overload_name().empty()) {
    return false;
  }
  const size_t n = stack->size();
  const c10::IValue& input = (*stack)[n - 6];
  if (!input.isTensor()) return false;
  const at::Tensor x = input.toTensor();
  const auto shape = (*stack)[n - 5].toIntVector();
  const at::Tensor weight = (*stack)[n - 4].isNone() ? at::Tensor() : (*stack)[n - 4].toTensor();
  const at::Tensor bias = (*stack)[n - 3].isNone() ? at::Tensor() : (*stack)[n - 3].toTensor();
  if (!mixed_layer_norm_is_fused(x, shape, weight, bias)) return false;
  const double eps = (*stack)[n - 2].toDouble();
  torch::jit::drop(*stack, 6);
  stack->emplace_back(mixed_layer_norm(x, shape, weight, bias, eps));
  return true;
}

// The same for aten::batch_norm(input, weight?, bias?, running_mean?,
// running_var?, training, momentum, eps, cudnn_enabled).
bool fused_batch_norm(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (op.schema().name() != "aten::batch_norm" || !op.schema().overload_name().empty()) {
    return false;
  }
  const size_t n = stack->size();
  auto tensor_at = [&](size_t from_end) {
    const c10::IValue& v = (*stack)[n - from_end];
    return v.isTensor() ? v.toTensor() : at::Tensor();
  };
  const at::Tensor x = tensor_at(9), weight = tensor_at(8), bias = tensor_at(7);
  const at::Tensor running_mean = tensor_at(6), running_var = tensor_at(5);
  const bool training = (*stack)[n - 4].toBool();
  if (!x.defined() ||
      !mixed_batch_norm_is_fused(x, weight, bias, running_mean, running_var, training)) {
    return false;
  }
  const double momentum = (*stack)[n - 3].toDouble(), eps = (*stack)[n - 2].toDouble();
  torch::jit::drop(*stack, 9);
  stack->emplace_back(
      mixed_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps));
  return true;
}

// kFp32OutputsAsInput on aten::gelu(self, approximate) with a 16-bit CPU
// input and the exact GELU: ampx's float32-math kernel (ampx::mixed_gelu).
bool fused_gelu(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (op.schema().name() != "aten::gelu" || !op.schema().overload_name().empty()) return false;
  const size_t n = stack->size();
  const c10::IValue& self = (*stack)[n - 2];
  if (!self.isTensor() || !mixed_gelu_is_fused(self.toTensor())) return false;
  // approximate: "none" or "tanh" (a string in every LibTorch ampx builds with).
  if ((*stack)[n - 1].toStringRef() != "none") return false;
  const at::Tensor x = self.toTensor();
  torch::jit::drop(*stack, 2);
  stack->emplace_back(mixed_gelu(x));
  return true;
}

// Whether every defined tensor in `ts` is a CPU tensor of one 16-bit dtype
// whose products ampx runs wide now (ampx::cpu_products_are_wide).
bool wide_operands(std::initializer_list<at::Tensor> ts) {
  const at::Tensor& first = *ts.begin();
  if (!first.defined() || !first.device().is_cpu() ||
      !cpu_products_are_wide(first.scalar_type())) {
    return false;
  }
  for (const at::Tensor& t : ts) {
    if (t.defined() && (!t.device().is_cpu() || t.scalar_type() != first.scalar_type())) {
      return false;
    }
  }
  return true;
}

// aten::scaled_dot_product_attention(query, key, value, attn_mask=None,
// dropout_p=0., is_causal=False, *, scale=None[, enable_gqa=False]) of
// bfloat16/float16 CPU tensors without a mask, dropout or grouped queries,
// whose sizes ampx's kernel takes: ampx::scaled_dot_product_attention.
// Anything else returns false and runs ATen's.
bool fused_attention(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t first = stack->size() - schema.arguments().size();
  auto arg = [&](const char* name) -> const c10::IValue* {
    const auto index = schema.argumentIndexWithName(name);
    return index ? &(*stack)[first + static_cast<size_t>(*index)] : nullptr;
  };
  const c10::IValue *q = arg("query"), *k = arg("key"), *v = arg("value");
  const c10::IValue *mask = arg("attn_mask"), *dropout = arg("dropout_p"),
                    *causal = arg("is_causal"), *scale = arg("scale"), *gqa = arg("enable_gqa");
  if (!q || !k || !v || !q->isTensor() || !k->isTensor() || !v->isTensor() || !causal ||
      (mask && !mask->isNone()) || (dropout && dropout->toDouble() != 0.0) ||
      (gqa && gqa->toBool())) {
    return false;
  }
  const at::Tensor query = q->toTensor(), key = k->toTensor(), value = v->toTensor();
  if (query.scalar_type() == at::kFloat ||
      !scaled_dot_product_attention_is_fused(query, key, value)) {
    return false;
  }
  const int64_t lead = query.dim() - 2;
  if (key.sizes().slice(0, lead) != query.sizes().slice(0, lead) ||
      value.sizes().slice(0, lead) != query.sizes().slice(0, lead) ||
      key.size(-1) != query.size(-1) || value.size(-2) != key.size(-2)) {
    return false;
  }
  std::optional<double> s;
  if (scale && !scale->isNone()) s = scale->toDouble();
  at::Tensor out = scaled_dot_product_attention(query, key, value, causal->toBool(), s);
  torch::jit::drop(*stack, schema.arguments().size());
  stack->emplace_back(std::move(out));
  return true;
}

// A product entry with wide products (PolicyEntry::wide) on the CPU: the
// default overloads of linear, matmul, mm, bmm and addmm (1-D bias, beta and
// alpha 1) whose operands pass wide_operands and whose sizes agree run
// ampx::wide_linear / wide_bmm / wide_matmul. Anything else (other shapes,
// whose errors then come from ATen) returns false and runs as before.
bool wide_product(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  if (!schema.overload_name().empty()) return false;
  const std::string& name = schema.name();
  if (name == "aten::scaled_dot_product_attention") return fused_attention(op, stack);
  const size_t n = stack->size();
  auto tensor = [&](size_t from_end) {
    const c10::IValue& v = (*stack)[n - from_end];
    return v.isTensor() ? v.toTensor() : at::Tensor();
  };
  auto is_one = [&](size_t from_end) {
    const c10::IValue& v = (*stack)[n - from_end];
    return v.isScalar() && v.toScalar().equal(1);
  };
  at::Tensor out;
  size_t args = 0;
  if (name == "aten::linear") {  // (input, weight, bias?)
    const at::Tensor x = tensor(3), w = tensor(2), b = tensor(1);
    if (!wide_operands({x, w, b}) || !w.defined() || !wide_linear_supports(x, w, b)) return false;
    out = wide_linear(x, w, b);
    args = 3;
  } else if (name == "aten::matmul") {  // (self, other)
    const at::Tensor a = tensor(2), b = tensor(1);
    if (!wide_operands({a, b}) || !b.defined() || !wide_matmul_supports(a, b)) return false;
    out = wide_matmul(a, b);
    args = 2;
  } else if (name == "aten::mm" || name == "aten::bmm") {  // (self, mat2)
    const at::Tensor a = tensor(2), b = tensor(1);
    const int64_t dim = name == "aten::mm" ? 2 : 3;
    if (!wide_operands({a, b}) || !b.defined() || a.dim() != dim || b.dim() != dim ||
        !wide_matmul_supports(a, b)) {
      return false;
    }
    out = dim == 2 ? wide_linear(a, b.t()) : wide_bmm(a, b);
    args = 2;
  } else if (name == "aten::addmm") {  // (self, mat1, mat2, *, beta, alpha)
    const at::Tensor bias = tensor(5), a = tensor(4), b = tensor(3);
    if (!wide_operands({a, b, bias}) || !b.defined() || !bias.defined() || a.dim() != 2 ||
        b.dim() != 2 || !wide_linear_supports(a, b.t(), bias) || !is_one(2) || !is_one(1)) {
      return false;
    }
    out = wide_linear(a, b.t(), bias);
    args = 5;
  } else {
    return false;
  }
  torch::jit::drop(*stack, args);
  stack->emplace_back(std::move(out));
  return true;
}

void run_policy(CastPolicy policy, c10::DeviceType device_type, bool wide,
                const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  // PyTorch's autocast kernels exclude the key for the op and everything it
  // calls; so do we (casts included: a cast must not meet our own kernel).
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  if (policy == CastPolicy::kPassthrough) {
    if (!(wide && wide_product(op, stack))) op.callBoxed(stack);
    return;
  }
  if (policy == CastPolicy::kFp32OutputsAsInput &&
      (fused_layer_norm(op, stack) || fused_batch_norm(op, stack) || fused_gelu(op, stack))) {
    return;
  }
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const size_t first_arg = stack->size() - args.size();

  // Input dtypes: the first floating one (kFp32OutputsAsInput) and the
  // widest (kPromote).
  // (Undefined: none yet. Not c10::optional: GCC 12 reports its storage as
  // maybe uninitialized here.)
  at::ScalarType first = at::ScalarType::Undefined, widest = at::ScalarType::Undefined;
  for (size_t i = 0; i < args.size(); ++i) {
    if (!castable(args[i])) continue;
    for_each_tensor((*stack)[first_arg + i], [&](const at::Tensor& t) {
      if (!eligible(t, device_type)) return;
      if (first == at::ScalarType::Undefined) {
        first = widest = t.scalar_type();
      } else {
        widest = at::promote_types(widest, t.scalar_type());
      }
    });
  }
  if (first == at::ScalarType::Undefined) {  // nothing to cast
    op.callBoxed(stack);
    return;
  }
  at::ScalarType to = at::kFloat;
  switch (policy) {
    case CastPolicy::kLowerPrecision:
      to = at::autocast::get_lower_precision_fp_from_device_type(device_type);
      break;
    case CastPolicy::kPromote:
      to = widest;
      break;
    default:
      break;
  }
  for (size_t i = 0; i < args.size(); ++i) {
    auto& v = (*stack)[first_arg + i];
    if (!castable(args[i]) || !has_tensor(v)) continue;
    // cached_cast: PyTorch's cast, weight-cast cache included (it caches
    // lower-precision casts of fp32 leaves that require grad).
    v = map_tensors(
        v, [&](const at::Tensor& t) { return at::autocast::cached_cast(to, t, device_type); });
  }
  if (wide && wide_product(op, stack)) return;
  op.callBoxed(stack);

  if (policy == CastPolicy::kFp32OutputsAsInput && first != at::kFloat) {
    const size_t returns = schema.returns().size();
    for (size_t i = stack->size() - returns; i < stack->size(); ++i) {
      auto& v = (*stack)[i];
      if (!has_tensor(v)) continue;
      v = map_tensors(
          v, [&](const at::Tensor& t) { return eligible(t, device_type) ? t.to(first) : t; });
    }
  }
}

template <CastPolicy P, c10::DeviceType D, bool W>
void policy_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  run_policy(P, D, W, op, stack);
}

template <c10::DeviceType D, bool W>
c10::KernelFunction kernel_for(CastPolicy policy) {
  switch (policy) {
    case CastPolicy::kLowerPrecision:
      return c10::KernelFunction::makeFromBoxedFunction<
          &policy_kernel<CastPolicy::kLowerPrecision, D, W>>();
    case CastPolicy::kFp32:
      return c10::KernelFunction::makeFromBoxedFunction<&policy_kernel<CastPolicy::kFp32, D, W>>();
    case CastPolicy::kPromote:
      return c10::KernelFunction::makeFromBoxedFunction<&policy_kernel<CastPolicy::kPromote, D, W>>();
    case CastPolicy::kPassthrough:
      return c10::KernelFunction::makeFromBoxedFunction<
          &policy_kernel<CastPolicy::kPassthrough, D, W>>();
    case CastPolicy::kFp32OutputsAsInput:
      return c10::KernelFunction::makeFromBoxedFunction<
          &policy_kernel<CastPolicy::kFp32OutputsAsInput, D, W>>();
  }
  TORCH_CHECK(false, "ampx: unknown CastPolicy ", static_cast<int>(policy));
}

}  // namespace

c10::KernelFunction make_policy_kernel(PolicyEntry entry, c10::DeviceType device_type) {
  if (entry.fallthrough) return c10::KernelFunction::makeFallthrough();
  // Stateless kernels, one per (policy, device): nothing to keep alive while
  // another thread drops the registration.
  if (device_type == c10::DeviceType::CUDA) {
    return kernel_for<c10::DeviceType::CUDA, false>(entry.policy);
  }
  return entry.wide ? kernel_for<c10::DeviceType::CPU, true>(entry.policy)
                    : kernel_for<c10::DeviceType::CPU, false>(entry.policy);
}

}  // namespace detail
}  // namespace ampx
