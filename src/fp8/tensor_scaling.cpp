// TensorScaling (one tensor role's FP8 scale: delayed or current scaling,
// its casts and recorded amaxes) and LinearScaling (a Linear layer's three
// roles, or its block recipe's rounding stream). The recipes and the
// delayed-scaling state they use: scaling.cpp.

#include "ampx/fp8/linear.h"
#include "ampx/fp8/scaling.h"
#include "autocast_internal.h"
#include "block/block_internal.h"
#include "cuda_cast.h"
#include "fp8_math.h"
#include "scaling_internal.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <torch/nn/module.h>
#include <torch/torch.h>

#include <atomic>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ampx {
namespace fp8 {

namespace {

std::atomic<int64_t> g_weight_casts{0};  // cast_weight's new casts (detail::weight_casts)

const char* role_name(int i) {
  static const char* names[] = {"input", "weight", "grad_output"};
  return names[i];
}

const Recipe& tensorwise(const Recipe& recipe) {
  TORCH_CHECK_VALUE(!recipe.is_block(), "ampx::fp8::TensorScaling: ", recipe.to_string(),
                    " scales blocks, not whole tensors: it has no tensor roles");
  return recipe;
}
}  // namespace

TensorScaling::TensorScaling(const Recipe& recipe, Direction pass, c10::Device device)
    : recipe_(tensorwise(recipe)), format_(format_for(recipe.fp8_format(), pass)) {
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

namespace {

// x's codes with `scale` in one CUDA pass, x^T's into `transposed` too when
// `asked` and x is 2-D, max|x| folded into `amax` when defined.
Fp8Tensor cuda_cast(const at::Tensor& x, Fp8Format format, const at::Tensor& scale,
                    const at::Tensor& scale_inv, const at::Tensor& amax, bool asked,
                    at::Tensor& transposed) {
  const bool transpose = asked && x.dim() == 2;
  detail::cuda::CastOut out = detail::cuda::cast(x, format, scale, transpose, amax);
  if (transpose) transposed = std::move(out.transposed);
  return {std::move(out.codes), scale_inv, format};
}

}  // namespace

// One cast before anything is recorded: what cast() gives, the amax it
// records (current scaling: always; delayed: where asked), and current
// scaling's scale.
struct TensorScaling::Fresh {
  Fp8Tensor out;
  at::Tensor transposed, amax, scale;
};

TensorScaling::Fresh TensorScaling::fresh(const at::Tensor& x, bool with_amax, bool transpose) {
  const bool fused = detail::cuda::takes(x);
  Fresh f;
  if (!delayed_) {
    f.amax = compute_amax(x);
    if (fused) {  // the amax reduction, the scale kernel, the cast: three launches
      f.scale = at::empty({1}, f.amax.options());
      const at::Tensor scale_inv = at::empty({1}, f.amax.options());
      detail::cuda::current_scale(f.amax, limits(format_).max,
                                  static_cast<float>(recipe_.current().amax_epsilon()),
                                  recipe_.current().power_2_scale(), f.scale, scale_inv);
      f.out = cuda_cast(x, format_, f.scale, scale_inv, at::Tensor(), transpose, f.transposed);
    } else {
      f.scale = current_scale(f.amax, format_, recipe_.current());
      f.out = {quantize(x, format_, f.scale), at::ones_like(f.scale).div(f.scale), format_};
    }
    return f;
  }
  // The scale of the steps before; clone scale_inv: the update below (or a
  // later one, before backward reads it) writes the state in place.
  const at::Tensor scale_inv = delayed_->scale_inv().clone();
  if (fused) {  // one pass: the codes, and the amax the next scale comes from
    if (with_amax) f.amax = at::zeros({1}, x.options().dtype(at::kFloat));
    f.out = cuda_cast(x, format_, delayed_->scale(), scale_inv, f.amax, transpose, f.transposed);
    return f;
  }
  f.out = {quantize(x, format_, delayed_->scale()), scale_inv, format_};
  if (with_amax) f.amax = compute_amax(x);
  return f;
}

void TensorScaling::check_group(const dist::ProcessGroup* group) const {
  TORCH_CHECK(group == nullptr || delayed_,
              "ampx::fp8: an amax_reduction_group applies to delayed scaling; this layer's "
              "recipe is ",
              recipe_.to_string(), " (each tensor is cast with its own amax)");
}

void TensorScaling::note(const Fresh& cast, const dist::ProcessGroup* group) {
  if (delayed_) {
    record_amax(cast.amax, group);
    return;
  }
  last_amax_.copy_(cast.amax);
  scale_.copy_(cast.scale);
  scale_inv_.copy_(cast.out.scale_inv);
}

Fp8Tensor TensorScaling::cast(const at::Tensor& x, bool record, const dist::ProcessGroup* group,
                              at::Tensor* transposed) {
  at::NoGradGuard no_grad;
  check_group(group);
  Fresh f = fresh(x, record, transposed != nullptr);
  if (record) note(f, group);
  if (transposed != nullptr) *transposed = std::move(f.transposed);
  return std::move(f.out);
}

// What cast_weight kept: a cast, and what it was cast from. The weight and
// its storage are held weakly (a replaced parameter is freed as without the
// cast kept; a weak reference also keeps the address from being reused, so
// a set_data that left and came back, as module.to() there and back does,
// is seen); data, version, sizes and dtype tell an in-place change.
struct TensorScaling::Kept {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> weight;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  const void* data = nullptr;
  int64_t version = 0;
  std::vector<int64_t> sizes;
  c10::ScalarType dtype = at::kFloat;
  bool transposed_asked = false;
  Fresh cast;

  Kept(const at::Tensor& w, bool asked, Fresh f)
      : weight(w.getIntrusivePtr()),
        storage(w.storage().getWeakStorageImpl()),
        data(w.data_ptr()),
        version(w._version()),
        sizes(w.sizes().vec()),
        dtype(w.scalar_type()),
        transposed_asked(asked),
        cast(std::move(f)) {}

  // Whether this is a cast of w as it is now, asked for the same outputs.
  bool of(const at::Tensor& w, bool asked) const {
    const c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> held = weight.lock();
    const c10::intrusive_ptr<c10::StorageImpl> held_storage = storage.lock();
    return held.get() == w.unsafeGetTensorImpl() &&
           held_storage.get() == w.storage().unsafeGetStorageImpl() && data == w.data_ptr() &&
           version == w._version() && w.sizes() == sizes && w.scalar_type() == dtype &&
           asked == transposed_asked;
  }
};

Fp8Tensor TensorScaling::cast_weight(const at::Tensor& w, WeightCasts casts, bool record,
                                     const dist::ProcessGroup* group, at::Tensor* transposed) {
  if (given_ && !w.is_inference() && given_->of(w, /*asked=*/true))
    return give(record, group, transposed);
  TORCH_CHECK(!is_weight_stand_in(w),
              "ampx::fp8: this layer's weight stands in for FP8 codes a sharding wrapper gathered "
              "(FullyShardedDataParallel's fp8_all_gather), but the layer holds none for it: was "
              "it converted again while its unit was gathered?");
  // An inference tensor has no version counter to tell its changes by, and
  // under InferenceMode the codes would be inference tensors, which a
  // later training forward could not save for its backward: neither keeps.
  if (casts == WeightCasts::kEveryForward || w.is_inference() || c10::InferenceMode::is_enabled()) {
    // A training forward drops what was kept (states are written then, so it
    // runs on one thread); a no-grad one may run beside others and leaves it.
    if (record && casts == WeightCasts::kEveryForward) kept_.reset();
    return cast(w, record, group, transposed);
  }
  at::NoGradGuard no_grad;
  check_group(group);
  const bool asked = transposed != nullptr;
  if (casts == WeightCasts::kFirstMicroBatch || !kept_ || !kept_->of(w, asked)) {
    kept_.reset();  // the old codes go before the new ones are made
    // With its amax: the later micro-batches record it.
    kept_ = std::make_shared<Kept>(w, asked, fresh(w, /*with_amax=*/true, asked));
    g_weight_casts.fetch_add(1);
  }
  if (record) note(kept_->cast, group);
  if (transposed != nullptr) *transposed = kept_->cast.transposed;
  return kept_->cast.out;
}

std::pair<at::Tensor, at::Tensor> TensorScaling::scales_for(const at::Tensor& amax) const {
  at::NoGradGuard no_grad;
  if (delayed_) return {delayed_->scale().clone(), delayed_->scale_inv().clone()};
  at::Tensor scale = current_scale(amax.to(at::kFloat).reshape({1}), format_, recipe_.current());
  at::Tensor scale_inv = at::ones_like(scale).div(scale);  // as fresh() computes it
  return {std::move(scale), std::move(scale_inv)};
}

void TensorScaling::give_weight(const at::Tensor& w, const at::Tensor& codes,
                                const at::Tensor& scale, const at::Tensor& scale_inv,
                                const at::Tensor& amax) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.sizes() == w.sizes(),
              "ampx::fp8::TensorScaling::give_weight: codes must be uint8 of the weight's shape ",
              w.sizes(), ", got ", codes.scalar_type(), " ", codes.sizes());
  Fresh f;
  f.out = {codes, scale_inv, format_};
  f.scale = scale;
  f.amax = amax.to(at::kFloat).reshape({1});
  given_ = std::make_shared<Kept>(w, /*asked=*/true, std::move(f));
}

Fp8Tensor TensorScaling::give(bool record, const dist::ProcessGroup* group,
                              at::Tensor* transposed) {
  at::NoGradGuard no_grad;
  check_group(group);
  Fresh& f = given_->cast;
  // The column-major operand CUDA's products take, once per gather.
  if (transposed != nullptr && !f.transposed.defined() && f.out.codes.is_cuda() &&
      detail::cuda::built() && f.out.codes.dim() == 2) {
    f.transposed = f.out.codes.t().contiguous();
  }
  if (record) note(f, group);
  if (transposed != nullptr) *transposed = f.transposed;
  return f.out;
}

at::Tensor weight_stand_in(at::IntArrayRef shape, const at::TensorOptions& options) {
  at::NoGradGuard no_grad;
  return at::full({1}, std::numeric_limits<float>::quiet_NaN(), options).expand(shape);
}

bool is_weight_stand_in(const at::Tensor& w) {
  if (!w.defined() || w.numel() <= 1) return false;
  for (const int64_t stride : w.strides()) {
    if (stride != 0) return false;
  }
  return true;
}

void TensorScaling::record_amax(at::Tensor amax, const dist::ProcessGroup* group) {
  if (group != nullptr) {
    detail::defer_amax(shared_from_this(), std::move(amax), group);
    return;
  }
  // On CUDA, the delayed-scaling updates of a region (or a backward) wait
  // for its end, where one launch updates every state (TE's fused update).
  // (A state not held by a shared_ptr, made by hand, records at once.)
  std::shared_ptr<TensorScaling> self = weak_from_this().lock();
  if (self && delayed_ && amax.is_cuda() && detail::cuda::built() &&
      detail::defer_update(std::move(self), amax)) {
    return;
  }
  record(amax);
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

namespace detail {

int64_t weight_casts() {
  return g_weight_casts.load();
}

void record_all(const std::vector<std::shared_ptr<TensorScaling>>& states,
                const std::vector<at::Tensor>& amaxes) {
  TORCH_INTERNAL_ASSERT(states.size() == amaxes.size());
  at::NoGradGuard no_grad;
  // The CUDA delayed-scaling states (amax where the state is): one launch.
  std::vector<cuda::DelayedArgs> batch;
  c10::optional<c10::Device> batch_device;
  for (size_t i = 0; i < states.size(); ++i) {
    TensorScaling& state = *states[i];
    const at::Tensor& last = state.last_amax();
    const bool batched = cuda::built() && state.recipe().is_delayed() && last.is_cuda() &&
                         amaxes[i].device() == last.device() &&
                         (!batch_device || *batch_device == last.device());
    if (!batched) {
      state.record(amaxes[i]);
      continue;
    }
    last.copy_(amaxes[i].reshape({1}));
    batch_device = last.device();
    batch.push_back(delayed_args(state.delayed_state(), last));
  }
  if (!batch.empty()) cuda::delayed_update(batch, *batch_device);
}

}  // namespace detail

LinearScaling::LinearScaling(const Recipe& recipe_, c10::Device device, const at::Tensor& weight_)
    : recipe(recipe_) {
  recipe.validate();
  if (!recipe.is_block()) {
    input = std::make_shared<TensorScaling>(recipe, Direction::kForward, device);
    weight = std::make_shared<TensorScaling>(recipe, Direction::kForward, device);
    grad_output = std::make_shared<TensorScaling>(recipe, Direction::kBackward, device);
  } else if (recipe.kind() == Recipe::Kind::kNvfp4 && recipe.nvfp4().stochastic_rounding()) {
    rounding = at::zeros({2}, at::TensorOptions().dtype(at::kLong).device(device));
    rounding[0] = detail::rounding_stream(recipe.nvfp4().seed(), weight_);
  }
}

void LinearScaling::register_buffers(torch::nn::Module& module, const std::string& prefix) const {
  if (rounding.defined()) module.register_buffer(prefix + "rounding", rounding);
  if (recipe.is_block()) return;
  const TensorScaling* roles[] = {input.get(), weight.get(), grad_output.get()};
  for (int i = 0; i < 3; ++i) {
    for (const auto& [suffix, tensor] : roles[i]->state_tensors()) {
      module.register_buffer(prefix + role_name(i) + "_" + suffix, tensor);
    }
  }
}

}  // namespace fp8
}  // namespace ampx
