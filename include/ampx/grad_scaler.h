#pragma once

/// \file
/// GradScaler: dynamic loss scaling against float16 gradient underflow, with
/// the semantics, defaults, state-dict keys and error texts of PyTorch's
/// `torch.amp.GradScaler`, plus hysteresis and scale bounds.
///
/// ```
///   ampx::GradScaler scaler;                  // init_scale 2^16, interval 2000
///   for (...) {
///     optimizer.zero_grad();
///     torch::Tensor loss;
///     { ampx::AutocastGuard autocast(torch::kCUDA); loss = loss_fn(model(x), y); }
///     scaler.scale(loss).backward();
///     scaler.unscale_(optimizer);             // optional: clip in real units
///     torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
///     scaler.step(optimizer);                 // skipped if any grad is inf/NaN
///     scaler.update();
///   }
/// ```
///
/// Per optimizer, an iteration moves READY -> UNSCALED (unscale_) -> STEPPED
/// (step); update() puts every optimizer back to READY. The scale lives on the
/// device of the first tensor passed to scale(). Not thread safe (nor is
/// PyTorch's); one scaler serves any number of optimizers and losses.
///
/// Opt-in diagnostics, free when off (no extra kernel, no host sync):
///
/// ```
///   ampx::GradScaler scaler(ampx::GradScalerOptions()
///                               .explain_skipped_steps(true)   // who overflowed
///                               .collapse_warning_steps(50));  // scale stuck falling
///   scaler.name_parameters(model->named_parameters());
///   scaler.protect_buffers(*model);   // BatchNorm stats survive skipped steps
///   ...
///   scaler.last_skipped_step()->to_string();
///   // "skipped step at iteration 7 (scale 65536): 2 of 4 gradients hold inf/NaN:
///   //  fc2.weight [1, 16] Float (16 non-finite), fc2.bias [1] Float (1 non-finite)"
///   scaler.scale_collapsed();         // false
/// ```

#include "ampx/scale_update.h"
#include "ampx/scaler_aware_optimizer.h"
#include "ampx/state_dict.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/UndefinedTensorImpl.h>
#include <c10/util/Optional.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
namespace optim {
class Optimizer;
}  // namespace optim
namespace serialize {
class InputArchive;
class OutputArchive;
}  // namespace serialize
}  // namespace torch

namespace ampx {

/// GradScaler's settings, PyTorch's defaults, set by chained calls:
/// `GradScalerOptions().init_scale(1024).hysteresis(2)`.
struct GradScalerOptions {
  /// Initial scale factor.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// Factor the scale is multiplied by after `growth_interval` clean steps (> 1).
  TORCH_ARG(double, growth_factor) = 2.0;
  /// Factor the scale is multiplied by on an overflow (in (0, 1)).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Consecutive clean steps before the scale grows.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// If false, every call is a pass-through and `step` just steps.
  TORCH_ARG(bool, enabled) = true;
  /// Overflowing steps tolerated before the scale backs off (each one is still
  /// skipped); refilled when the scale grows. 1 = PyTorch, 2 = Megatron/DeepSpeed.
  TORCH_ARG(int64_t, hysteresis) = 1;
  /// Floor for the scale after each update (none by default, as PyTorch).
  TORCH_ARG(c10::optional<double>, min_scale) = c10::nullopt;
  /// Ceiling for the scale after each update (none by default, as PyTorch;
  /// `ampx::initialize`'s dynamic scaler sets Apex's 2^24).
  TORCH_ARG(c10::optional<double>, max_scale) = c10::nullopt;
  /// On a skipped step, find the parameters whose gradients hold inf/NaN
  /// (one check and one host read per parameter, on skipped steps only),
  /// record them (`skipped_steps()`) and TORCH_WARN one line. Off: no cost.
  TORCH_ARG(bool, explain_skipped_steps) = false;
  /// N > 0: TORCH_WARN once ("loss scale collapsed: ...") when N consecutive
  /// update() calls each found inf/NaN, i.e. the scale fell (or sat at
  /// min_scale, or was held by hysteresis) N times in a row without growing.
  /// Costs one host read per update(). 0 = off (default).
  TORCH_ARG(int64_t, collapse_warning_steps) = 0;
};

/// A gradient that held inf/NaN on a skipped step.
struct NonFiniteGrad {
  /// The name given by GradScaler::name_parameters, else
  /// "param_groups[g].params[i]" (the optimizer's indices).
  std::string name;
  std::vector<int64_t> sizes;  ///< the gradient's shape
  c10::ScalarType dtype;       ///< the gradient's dtype
  /// Elements that are inf or NaN (of the values, for a sparse gradient).
  int64_t non_finite;
};

/// Why GradScaler skipped one optimizer's step (explain_skipped_steps).
struct SkippedStep {
  /// update() calls before the step: 0 = the first iteration.
  int64_t iteration;
  /// The loss scale the gradients were computed with.
  double scale;
  /// Parameters with a gradient (the optimizer's, in its order).
  int64_t num_grads;
  /// Those that held inf/NaN, in the optimizer's order. Empty when only the
  /// found-inf hook's agreement (another rank) skipped the step.
  std::vector<NonFiniteGrad> grads;
  /// One line, as TORCH_WARN prints it (at most 8 names, then "and N more").
  std::string to_string() const;
};

/// Per-optimizer stage within one iteration (PyTorch's OptState).
enum class OptState { kReady, kUnscaled, kStepped };

/// What GradScaler::step did. Converting it to bool answers "did the
/// optimizer step?"; for a ScalerAwareOptimizer that reads the found-inf flag
/// (a host sync on CUDA), which is why the result is not a plain bool.
class StepResult {
 public:
  /// A result known on the host: `stepped` or skipped.
  explicit StepResult(bool stepped) : known_(stepped) {}
  /// A result that a float32 [] flag on the device holds (1 = skipped), read
  /// only when asked.
  explicit StepResult(at::Tensor found_inf) : found_inf_(std::move(found_inf)) {}
  /// Whether the optimizer stepped (false: skipped on inf/NaN).
  bool stepped() const;
  /// stepped(): `if (scaler.step(opt))` asks whether the optimizer stepped.
  explicit operator bool() const { return stepped(); }
  /// float32 [] flag (1 = skipped), undefined for a plain bool result.
  const at::Tensor& found_inf() const { return found_inf_; }

 private:
  c10::optional<bool> known_;
  at::Tensor found_inf_;
};

/// Dynamic loss scaling, PyTorch's `torch.amp.GradScaler` (the top of this
/// header shows the loop).
class GradScaler {
 public:
  /// Checks `options` when enabled (growth_factor > 1, backoff_factor in
  /// (0, 1), init_scale finite and > 0, ...); the scale is made by scale().
  explicit GradScaler(GradScalerOptions options = {});

  /// `outputs * scale`. The first call creates the scale on outputs' device.
  at::Tensor scale(const at::Tensor& outputs);
  /// Each of `outputs` times the scale (copied once to each output device).
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs);

  /// Divides `optimizer`'s gradients by the scale in place and records
  /// whether any was inf/NaN. At most once per optimizer per iteration, before
  /// `step`. float16 gradients are refused (as in PyTorch).
  void unscale_(torch::optim::Optimizer& optimizer);

  /// Unscales if `unscale_` was not called, then runs `optimizer.step()`
  /// unless a gradient was inf/NaN; `if (scaler.step(opt))` tells whether it
  /// stepped. Reads the found-inf flag on the host (one sync), as PyTorch
  /// does, except for a ScalerAwareOptimizer, whose step_scaled() gets the
  /// scale and the flag as tensors (grads checked, not unscaled, when
  /// unscale_ was not called; float16 grads allowed there, as in PyTorch).
  StepResult step(torch::optim::Optimizer& optimizer);

  /// Updates the scale from this iteration's overflow checks (all optimizers).
  /// Buffers given to protect_buffers() are restored where any check found
  /// inf/NaN.
  void update();
  /// Sets the scale to `new_scale` instead (protected buffers as update()).
  void update(double new_scale);
  /// Copies a 1-element float tensor (no grad, on the scale's device).
  void update(const at::Tensor& new_scale);

  /// The current scale as a number (syncs); init_scale before the first
  /// scale(); 1.0 when disabled.
  double get_scale() const;
  /// The scale tensor without syncing; undefined before the first scale().
  at::Tensor get_scale_async() const { return scale_; }
  /// Consecutive clean steps counted towards the next growth.
  int64_t get_growth_tracker() const;
  /// Overflows still absorbed before the next backoff (see hysteresis).
  int64_t get_hysteresis_tracker() const;

  /// GradScalerOptions::growth_factor.
  double get_growth_factor() const { return rule_.growth_factor; }
  /// Changes the growth factor for later updates (not checked, as in PyTorch).
  void set_growth_factor(double new_factor) { rule_.growth_factor = new_factor; }
  /// GradScalerOptions::backoff_factor.
  double get_backoff_factor() const { return rule_.backoff_factor; }
  /// Changes the backoff factor for later updates (not checked, as in PyTorch).
  void set_backoff_factor(double new_factor) { rule_.backoff_factor = new_factor; }
  /// GradScalerOptions::growth_interval.
  int64_t get_growth_interval() const { return rule_.growth_interval; }
  /// Changes the growth interval for later updates (not checked, as in PyTorch).
  void set_growth_interval(int64_t new_interval) { rule_.growth_interval = new_interval; }
  /// GradScalerOptions::hysteresis.
  int64_t get_hysteresis() const { return rule_.hysteresis; }
  /// GradScalerOptions::min_scale.
  c10::optional<double> get_min_scale() const { return rule_.min_scale; }
  /// GradScalerOptions::max_scale.
  c10::optional<double> get_max_scale() const { return rule_.max_scale; }
  /// GradScalerOptions::enabled: false makes every call a pass-through.
  bool is_enabled() const { return enabled_; }

  /// Where `optimizer` is in the current iteration.
  OptState stage(const torch::optim::Optimizer& optimizer) const;

  /// The found-inf flags (float32 [], 1 = overflow) recorded for `optimizer`
  /// this iteration, one per gradient device. They are the tensors `step` and
  /// `update` read, so an in-place all-reduce (MAX) on them makes every rank
  /// of a data-parallel job skip and back off together.
  std::vector<at::Tensor> found_inf_per_device(const torch::optim::Optimizer& optimizer) const;

  /// Called once on each found-inf check the scaler records (in unscale_(),
  /// or in step() when it checks the gradients itself) with the flag summed
  /// over devices (float32 [], on the scale's device), before step() or
  /// update() reads it; it may change the flag in place. Data-parallel
  /// training agrees on overflows here: ampx::dist::synchronize_found_inf
  /// installs an all-reduce MAX, so that every rank skips and backs off
  /// together when any rank's gradients overflowed. Empty: none (default).
  using FoundInfHook = std::function<void(at::Tensor& found_inf)>;
  /// Installs `hook` (see FoundInfHook), replacing any earlier one.
  void set_found_inf_hook(FoundInfHook hook) { found_inf_hook_ = std::move(hook); }

  /// Names for explanations of skipped steps, e.g. `model->named_parameters()`.
  /// Looked up by tensor identity (never serialized); later calls add names.
  void name_parameters(const torch::OrderedDict<std::string, at::Tensor>& named_parameters);

  /// How many skipped steps skipped_steps() keeps.
  static constexpr size_t kSkippedStepHistory = 16;
  /// The last kSkippedStepHistory skipped steps, oldest first (empty unless
  /// explain_skipped_steps).
  const std::deque<SkippedStep>& skipped_steps() const { return skipped_steps_; }
  /// The newest of skipped_steps(), if any.
  c10::optional<SkippedStep> last_skipped_step() const;

  /// Whether the last collapse_warning_steps updates all found inf/NaN
  /// (always false when collapse_warning_steps is 0). The warning that
  /// goes with it is emitted once per scaler.
  bool scale_collapsed() const;

  /// Keeps `module`'s buffers (recursively: BatchNorm's running_mean,
  /// running_var, num_batches_tracked, ...) as they were before an iteration
  /// whose step is skipped: update() restores them from a snapshot where the
  /// found-inf flags say so, on the buffers' device and without a host sync,
  /// then snapshots them again. The scaler holds references to the buffers
  /// (a copy each); call it after moving the module. No-op when disabled.
  void protect_buffers(const torch::nn::Module& module);

  /// PyTorch's keys `scale`, `growth_factor`, `backoff_factor`,
  /// `growth_interval`, `_growth_tracker`, plus ampx's `hysteresis`,
  /// `_hysteresis_tracker`, `min_scale`, `max_scale` and
  /// `_ampx_state_version`. Empty when disabled, as in PyTorch.
  StateDict state_dict() const;
  /// Accepts PyTorch's state dicts (ampx's keys are optional) and ampx's.
  /// Validates everything before changing anything.
  void load_state_dict(const StateDict& state_dict);

  /// LibTorch archive serialization (embeds in torch::save checkpoints).
  void save(torch::serialize::OutputArchive& archive) const;
  /// Reads what save() wrote; errors if `archive` holds no GradScaler state.
  void load(torch::serialize::InputArchive& archive);

 private:
  struct PerOptimizerState {
    OptState stage = OptState::kReady;
    std::unordered_map<c10::Device, at::Tensor> found_inf_per_device;
  };

  // A parameter's name; the weak reference keeps the address from being
  // reused, so a live entry is the parameter it was given for.
  struct NamedParameter {
    std::string name;
    c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> param;
  };
  struct ProtectedBuffer {
    at::Tensor buffer;    // the module's tensor
    at::Tensor snapshot;  // its value after the last update()
  };

  void lazy_init(const c10::Device& device);
  // explain_skipped_steps: records and warns why `optimizer`'s step is skipped.
  void explain_skipped_step(const torch::optim::Optimizer& optimizer);
  // collapse_warning_steps: follows the scale across one update() (host read).
  void track_collapse(const at::Tensor& scale_before, const at::Tensor& found_inf);
  // protect_buffers: restores buffers where found_inf > 0, then snapshots.
  void restore_buffers(const at::Tensor& found_inf);
  // Every found-inf flag recorded this iteration, over all optimizers.
  std::vector<at::Tensor> all_found_infs() const;
  // The end of update(double) and update(Tensor): buffers, streak, counters.
  void finish_manual_update();
  void check_initialized(const char* funcname) const;
  // Applies found_inf_hook_ (if any) to the flags of one check.
  void agree_on_found_inf(std::unordered_map<c10::Device, at::Tensor>& per_device) const;
  std::unordered_map<c10::Device, at::Tensor> unscale_grads(torch::optim::Optimizer& optimizer,
                                                  const at::Tensor& inv_scale,
                                                  const at::Tensor& found_inf, bool allow_fp16);

  bool enabled_;
  ScaleUpdateRule rule_;
  double init_scale_;
  int64_t init_growth_tracker_ = 0;
  int64_t init_hysteresis_tracker_;
  at::Tensor scale_;               // float32 [] on the loss' device
  at::Tensor growth_tracker_;      // int32 []
  at::Tensor hysteresis_tracker_;  // int32 []
  // Keyed by identity as PyTorch keys by id(optimizer); never serialized.
  std::unordered_map<const torch::optim::Optimizer*, PerOptimizerState> per_optimizer_;
  FoundInfHook found_inf_hook_;
  // Diagnostics (GradScalerOptions::explain_skipped_steps and
  // collapse_warning_steps, protect_buffers); host-side, never serialized.
  bool explain_skipped_steps_;
  int64_t collapse_warning_steps_;
  int64_t updates_ = 0;  // update() calls so far
  std::unordered_map<const c10::TensorImpl*, NamedParameter> parameter_names_;
  std::deque<SkippedStep> skipped_steps_;
  int64_t overflow_streak_ = 0;       // consecutive update()s that found inf/NaN
  std::deque<double> scale_history_;  // the scale before and after each of them
  bool collapse_warned_ = false;
  std::vector<ProtectedBuffer> protected_buffers_;
};

/// `scaler.save(archive)`, so that `torch::save(scaler, path)` works.
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const GradScaler& scaler);
/// `scaler.load(archive)`, so that `torch::load(scaler, path)` works.
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           GradScaler& scaler);

}  // namespace ampx
