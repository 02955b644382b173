#include "ampx/fp8/linear.h"

#include "../kernels/function_args.h"
#include "ampx/autocast.h"
#include "ampx/detail/compat.h"
#include "ampx/dist.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/library.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/linear.h>

#include <atomic>
#include <cmath>
#include <exception>
#include <mutex>
#include <unordered_map>

namespace ampx {
namespace fp8 {
namespace {

// The dispatch key converted torch::nn::Linear layers are caught on: a mode
// key above Autocast and Autograd that LibTorch registers nothing on
// (ampx::debug uses TESTING_ONLY_GenericMode, the one above it).
constexpr c10::DispatchKey kKey = c10::DispatchKey::TESTING_ONLY_GenericWrapper;

using Pending = std::vector<std::pair<std::shared_ptr<TensorScaling>, at::Tensor>>;

}  // namespace

namespace detail {
// The innermost region on this thread. (Outside the anonymous namespace:
// Fp8AutocastGuard::Region, declared in the public header, holds one.)
struct RegionState {
  bool enabled = false;
  const dist::ProcessGroup* group = nullptr;
  std::vector<std::pair<std::shared_ptr<TensorScaling>, at::Tensor>>* pending =
      nullptr;  // forward amaxes awaiting the group's reduction
};
}  // namespace detail

namespace {
using detail::RegionState;
thread_local RegionState t_region;

// Max-reduces the amaxes of `pending` over `group` in one all-reduce and
// records them; a state cast twice records the larger amax once.
void reduce_and_record(Pending& pending, const dist::ProcessGroup& group) {
  if (pending.empty()) return;
  std::vector<std::shared_ptr<TensorScaling>> states;
  std::vector<at::Tensor> amaxes;
  std::unordered_map<TensorScaling*, size_t> index;
  for (auto& [state, amax] : pending) {
    auto it = index.find(state.get());
    if (it == index.end()) {
      index.emplace(state.get(), states.size());
      states.push_back(state);
      amaxes.push_back(amax);
    } else {
      amaxes[it->second] = at::maximum(amaxes[it->second], amax);
    }
  }
  pending.clear();
  at::Tensor all = at::cat(amaxes);
  group.all_reduce_max(all);
  for (size_t i = 0; i < states.size(); ++i) {
    states[i]->record(all.slice(0, static_cast<int64_t>(i), static_cast<int64_t>(i) + 1));
  }
}

// Output-gradient amaxes of the running backward, reduced when it ends.
struct BackwardPending {
  std::mutex mutex;
  Pending pending;
  const dist::ProcessGroup* group = nullptr;
  bool queued = false;
};
BackwardPending& backward_pending() {
  static auto* p = new BackwardPending();
  return *p;
}

void flush_backward() {
  auto& b = backward_pending();
  Pending pending;
  const dist::ProcessGroup* group = nullptr;
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    pending.swap(b.pending);
    group = b.group;
    b.group = nullptr;
    b.queued = false;
  }
  if (group) reduce_and_record(pending, *group);
}

void defer_backward(std::shared_ptr<TensorScaling> state, at::Tensor amax,
                    const dist::ProcessGroup* group) {
  auto& b = backward_pending();
  std::lock_guard<std::mutex> lock(b.mutex);
  TORCH_CHECK(b.group == nullptr || b.group == group,
              "ampx::fp8: one backward ran FP8 layers of regions with different "
              "amax_reduction_groups");
  b.group = group;
  b.pending.emplace_back(std::move(state), std::move(amax));
  if (!b.queued) {
    b.queued = true;
    torch::autograd::Engine::get_default_engine().queue_callback(&flush_backward);
  }
}

// ---- the matrix products ---------------------------------------------------

struct Operand {
  at::Tensor codes;  // uint8
  Fp8Format format;
  at::Tensor scale_inv;
  at::Tensor value() const { return dequantize(codes, format, scale_inv, at::kFloat); }
};

std::atomic<int64_t> g_scaled_mm_calls{0};

#if AMPX_HAS_SCALED_MM
// a [M, K] times b [N, K] transposed on FP8 tensor cores, float32 result;
// undefined where the device or the shapes do not allow it (then the caller
// emulates). PyTorch wants a row-major, b^T column-major, every dim % 16.
at::Tensor scaled_mm_nt(const Operand& a, const Operand& b) {
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
at::Tensor scaled_mm_nt(const Operand&, const Operand&) {
  return {};
}
#endif

// y [N, out] = x [N, in] . w [out, in]^T
at::Tensor forward_product(const Operand& x, const Operand& w) {
  at::Tensor y = scaled_mm_nt(x, w);
  return y.defined() ? y : at::mm(x.value(), w.value().t());
}

// grad_x [N, in] = g [N, out] . w [out, in]
at::Tensor input_grad_product(const Operand& g, const Operand& w) {
  at::Tensor y;
  if (g.codes.is_cuda()) y = scaled_mm_nt(g, {w.codes.t().contiguous(), w.format, w.scale_inv});
  return y.defined() ? y : at::mm(g.value(), w.value());
}

// grad_w [out, in] = g [N, out]^T . x [N, in]
at::Tensor weight_grad_product(const Operand& g, const Operand& x) {
  at::Tensor y;
  if (g.codes.is_cuda()) {
    y = scaled_mm_nt({g.codes.t().contiguous(), g.format, g.scale_inv},
                     {x.codes.t().contiguous(), x.format, x.scale_inv});
  }
  return y.defined() ? y : g.value().t().mm(x.value());
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
    const auto xc = scaling->input->cast(x2, record, group);
    const auto wc = scaling->weight->cast(weight, record, group);
    const Operand xo{xc.codes, scaling->input->format(), xc.scale_inv};
    const Operand wo{wc.codes, scaling->weight->format(), wc.scale_inv};
    at::Tensor y = forward_product(xo, wo);
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
    const Operand xo{saved[0], scaling->input->format(), saved[2]};
    const Operand wo{saved[1], scaling->weight->format(), saved[3]};
    const at::Tensor g = grads[0].reshape({-1, wo.codes.size(0)}).to(at::kFloat);
    const auto gc = scaling->grad_output->cast(g, /*record=*/true, group);
    const Operand go{gc.codes, scaling->grad_output->format(), gc.scale_inv};
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

// ---- converted torch::nn::Linear layers --------------------------------------

struct Converted {
  c10::weak_intrusive_ptr<c10::TensorImpl> weight;
  std::shared_ptr<LinearScaling> scaling;
  c10::optional<c10::ScalarType> output_dtype;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const c10::TensorImpl*, Converted> layers;
  std::unique_ptr<torch::Library> fallback, kernels;
};
Registry& registry() {
  static auto* r = new Registry();
  return *r;
}

// The converted layer `weight` belongs to, if any.
c10::optional<Converted> lookup(const at::Tensor& weight) {
  if (!weight.defined()) return c10::nullopt;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.layers.find(weight.unsafeGetTensorImpl());
  if (it == r.layers.end()) return c10::nullopt;
  const auto alive = it->second.weight.lock();
  if (!alive || alive.get() != weight.unsafeGetTensorImpl()) {  // freed, address reused
    r.layers.erase(it);
    return c10::nullopt;
  }
  return it->second;
}

// The converted weight `t` is exactly the transpose of, as F::linear passes
// it to addmm and matmul (weight.t()).
at::Tensor transposed_base(const at::Tensor& t) {
  if (!t.defined() || t.dim() != 2 || !t.is_view()) return {};
  const at::Tensor base(at::TensorBase(t._base()));
  if (!base.defined() || base.dim() != 2 ||
      base.sizes() != at::IntArrayRef({t.size(1), t.size(0)}) || t.stride(0) != base.stride(1) ||
      t.stride(1) != base.stride(0) || t.storage_offset() != base.storage_offset()) {
    return {};
  }
  return base;
}

// Runs the FP8 product for a converted layer's op, or the op below this key.
// The ops are those LibTorch's C++ Linear and F::linear call (addmm for 2-D
// inputs with a bias, matmul otherwise, the bias then added by the caller)
// and Python's at::linear.
void linear_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                   torch::jit::Stack* stack) {
  const auto below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey);
  const auto& name = op.schema().name();
  const size_t n = stack->size();
  at::Tensor input, weight, bias;
  size_t num_args = 0;
  if (name == "aten::linear") {  // (input, weight, bias?)
    num_args = 3;
    input = (*stack)[n - 3].toTensor();
    weight = (*stack)[n - 2].toTensor();
    if (!(*stack)[n - 1].isNone()) bias = (*stack)[n - 1].toTensor();
  } else if (name == "aten::addmm") {  // (self, mat1, mat2, beta, alpha)
    num_args = 5;
    const at::Tensor& self = (*stack)[n - 5].toTensor();
    weight = transposed_base((*stack)[n - 3].toTensor());
    const bool plain = (*stack)[n - 2].toScalar().equal(1) && (*stack)[n - 1].toScalar().equal(1);
    if (weight.defined() && plain && self.dim() == 1 && self.size(0) == weight.size(0)) {
      input = (*stack)[n - 4].toTensor();
      bias = self;
    } else {
      weight = at::Tensor();
    }
  } else if (name == "aten::matmul") {  // (self, other)
    num_args = 2;
    input = (*stack)[n - 2].toTensor();
    weight = transposed_base((*stack)[n - 1].toTensor());
  }
  c10::optional<Converted> layer;
  if (t_region.enabled && weight.defined()) layer = lookup(weight);
  if (!layer) {
    op.redispatchBoxed(below, stack);
    return;
  }
  torch::jit::drop(*stack, num_args);
  c10::impl::ExcludeDispatchKeyGuard exclude(kKey);
  stack->emplace_back(detail::fp8_linear(input, weight, bias, layer->scaling, layer->output_dtype));
}

// A fallthrough for every op on kKey and the kernel for aten::linear, once.
void register_kernels() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.fallback) return;
  try {
    auto fallback =
        std::make_unique<torch::Library>(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
    fallback->fallback(torch::CppFunction::makeFallthrough());
    auto kernels =
        std::make_unique<torch::Library>(torch::Library::IMPL, "aten", kKey, __FILE__, __LINE__);
    for (const char* op : {"linear", "addmm", "matmul"}) {
      kernels->impl(op, torch::CppFunction::makeFromBoxedFunction<&linear_kernel>());
    }
    r.fallback = std::move(fallback);
    r.kernels = std::move(kernels);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false,
                "ampx::fp8: cannot register the aten::linear/addmm/matmul kernels on "
                "TESTING_ONLY_GenericWrapper that FP8 regions use (is something else using that "
                "key?): ",
                e.what_without_backtrace());
  }
}

const char* role_name(int i) {
  static const char* names[] = {"input", "weight", "grad_output"};
  return names[i];
}

}  // namespace

// ---- TensorScaling -------------------------------------------------------------

TensorScaling::TensorScaling(const Recipe& recipe, Pass pass, c10::Device device)
    : recipe_(recipe), format_(format_for(recipe.fp8_format(), pass)) {
  recipe_.validate();
  const auto options = at::TensorOptions().dtype(at::kFloat).device(device);
  last_amax_ = at::zeros({1}, options);
  if (recipe_.is_delayed()) {
    delayed_ = std::make_unique<DelayedScalingState>(recipe_.delayed(), pass, device);
  } else {
    scale_ = at::ones({1}, options);
    scale_inv_ = at::ones({1}, options);
  }
}

DelayedScalingState& TensorScaling::delayed_state() {
  TORCH_CHECK(delayed_ != nullptr, "ampx::fp8: this layer's recipe is ", recipe_.to_string(),
              ", which has no delayed-scaling state");
  return *delayed_;
}

const at::Tensor& TensorScaling::scale() const {
  return delayed_ ? delayed_->scale() : scale_;
}

const at::Tensor& TensorScaling::scale_inv() const {
  return delayed_ ? delayed_->scale_inv() : scale_inv_;
}

std::vector<std::pair<std::string, at::Tensor>> TensorScaling::state_tensors() const {
  if (delayed_) {
    return {{"amax_history", delayed_->amax_history()},
            {"scale", delayed_->scale()},
            {"scale_inv", delayed_->scale_inv()}};
  }
  return {{"amax", last_amax_}, {"scale", scale_}, {"scale_inv", scale_inv_}};
}

TensorScaling::Cast TensorScaling::cast(const at::Tensor& x, bool record,
                                        const dist::ProcessGroup* group) {
  at::NoGradGuard no_grad;
  if (!delayed_) {
    TORCH_CHECK(group == nullptr,
                "ampx::fp8: an amax_reduction_group applies to delayed scaling; this layer's "
                "recipe is ",
                recipe_.to_string(), " (each tensor is cast with its own amax)");
    const at::Tensor amax = compute_amax(x);
    const at::Tensor scale = current_scale(amax, format_, recipe_.current());
    const at::Tensor scale_inv = at::ones_like(scale).div(scale);
    if (record) {
      last_amax_.copy_(amax);
      scale_.copy_(scale);
      scale_inv_.copy_(scale_inv);
    }
    return {quantize(x, format_, scale), scale_inv};
  }
  // The scale of the steps before; clone scale_inv: the update below (or a
  // later one, before backward reads it) writes the state in place.
  Cast out{quantize(x, format_, delayed_->scale()), delayed_->scale_inv().clone()};
  if (record) {
    at::Tensor amax = compute_amax(x);
    if (group == nullptr) {
      this->record(amax);
    } else if (t_region.pending != nullptr && t_region.group == group) {
      t_region.pending->emplace_back(shared_from_this(), std::move(amax));
    } else {  // backward: the region has ended, the backward's end reduces
      defer_backward(shared_from_this(), std::move(amax), group);
    }
  }
  return out;
}

void TensorScaling::record(const at::Tensor& amax) {
  at::NoGradGuard no_grad;
  // Under delayed scaling last_amax_ is no module buffer (the history is), so
  // it stays where it was made when the module moves: it follows the amaxes.
  if (last_amax_.device() != amax.device()) {
    last_amax_ = at::zeros({1}, amax.options().dtype(at::kFloat));
  }
  last_amax_.copy_(amax.reshape({1}));
  if (delayed_) delayed_->update(last_amax_);
}

LinearScaling::LinearScaling(const Recipe& recipe_, c10::Device device)
    : recipe(recipe_),
      input(std::make_shared<TensorScaling>(recipe_, Pass::kForward, device)),
      weight(std::make_shared<TensorScaling>(recipe_, Pass::kForward, device)),
      grad_output(std::make_shared<TensorScaling>(recipe_, Pass::kBackward, device)) {}

void LinearScaling::register_buffers(torch::nn::Module& module, const std::string& prefix) const {
  const TensorScaling* roles[] = {input.get(), weight.get(), grad_output.get()};
  for (int i = 0; i < 3; ++i) {
    for (const auto& [suffix, tensor] : roles[i]->state_tensors()) {
      module.register_buffer(prefix + role_name(i) + "_" + suffix, tensor);
    }
  }
}

// ---- regions -----------------------------------------------------------------------

struct Fp8AutocastGuard::Region {
  RegionState previous;
  bool key_was_included = false;
  Pending pending;
};

Fp8AutocastGuard::Fp8AutocastGuard(bool enabled)
    : Fp8AutocastGuard(Fp8AutocastOptions().enabled(enabled)) {}

Fp8AutocastGuard::Fp8AutocastGuard(const Fp8AutocastOptions& options)
    : region_(std::make_unique<Region>()) {
  if (options.enabled()) register_kernels();
  region_->previous = t_region;
  region_->key_was_included = c10::impl::tls_is_dispatch_key_included(kKey);
  t_region.enabled = options.enabled();
  t_region.group = options.enabled() ? options.amax_reduction_group() : nullptr;
  t_region.pending = t_region.group ? &region_->pending : nullptr;
  c10::impl::tls_set_dispatch_key_included(kKey, options.enabled());
}

Fp8AutocastGuard::~Fp8AutocastGuard() noexcept(false) {
  const RegionState mine = t_region;
  t_region = region_->previous;
  c10::impl::tls_set_dispatch_key_included(kKey, region_->key_was_included);
  // The forward amaxes of the region, reduced over the group; not while an
  // exception unwinds (the other ranks may never get here).
  if (mine.group && std::uncaught_exceptions() == 0)
    reduce_and_record(region_->pending, *mine.group);
}

bool is_fp8_enabled() {
  return t_region.enabled;
}

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
  scaling_ = std::make_shared<LinearScaling>(options.recipe(), weight.device());
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

// ---- conversion -----------------------------------------------------------------------

std::vector<std::string> convert_linears(torch::nn::Module& model, const ConvertOptions& options) {
  options.recipe().validate();
  register_kernels();
  std::vector<std::string> converted;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    auto* linear = dynamic_cast<torch::nn::LinearImpl*>(item.value().get());
    if (linear == nullptr) continue;
    const auto& o = linear->options;
    const bool wanted = options.filter() ? options.filter()(item.key(), *linear)
                                         : o.in_features() % 16 == 0 && o.out_features() % 16 == 0;
    if (!wanted) continue;
    const at::Tensor& w = linear->weight;
    TORCH_CHECK(!lookup(w), "ampx::fp8::convert_linears: '", item.key(),
                "' is already an FP8 layer");
    auto scaling = std::make_shared<LinearScaling>(options.recipe(), w.device());
    scaling->register_buffers(*linear, "fp8_");
    {
      auto& r = registry();
      std::lock_guard<std::mutex> lock(r.mutex);
      r.layers.erase(w.unsafeGetTensorImpl());  // a freed weight's address, reused
      r.layers.emplace(w.unsafeGetTensorImpl(),
                       Converted{c10::weak_intrusive_ptr<c10::TensorImpl>(w.getIntrusivePtr()),
                                 scaling, options.output_dtype()});
    }
    converted.push_back(item.key());
  }
  return converted;
}

std::shared_ptr<LinearScaling> scaling_of(torch::nn::Module& module) {
  if (auto* fp8 = dynamic_cast<LinearImpl*>(&module)) return fp8->scaling_;
  if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&module)) {
    if (auto layer = lookup(linear->weight)) return layer->scaling;
  }
  return nullptr;
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
  // Inference (no grad) casts with the current scales and leaves them be.
  const bool record = at::GradMode::is_enabled();
  return Fp8LinearFunction::apply(x, weight, ampx::detail::optional_tensor(bias), scaling,
                                  output_dtype_for(x, output_dtype), t_region.group, record);
}

}  // namespace detail

}  // namespace fp8
}  // namespace ampx
