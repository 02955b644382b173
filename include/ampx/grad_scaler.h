#pragma once

// GradScaler: dynamic loss scaling against float16 gradient underflow, with
// the semantics, defaults, state-dict keys and error texts of PyTorch's
// `torch.amp.GradScaler`, plus hysteresis and scale bounds.
//
//   ampx::GradScaler scaler;                  // init_scale 2^16, interval 2000
//   for (...) {
//     optimizer.zero_grad();
//     torch::Tensor loss;
//     { ampx::AutocastGuard autocast(torch::kCUDA); loss = loss_fn(model(x), y); }
//     scaler.scale(loss).backward();
//     scaler.unscale_(optimizer);             // optional: clip in real units
//     torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
//     scaler.step(optimizer);                 // skipped if any grad is inf/NaN
//     scaler.update();
//   }
//
// Per optimizer, an iteration moves READY -> UNSCALED (unscale_) -> STEPPED
// (step); update() puts every optimizer back to READY. The scale lives on the
// device of the first tensor passed to scale(). Not thread safe (nor is
// PyTorch's); one scaler serves any number of optimizers and losses.

#include "ampx/scale_update.h"
#include "ampx/scaler_aware_optimizer.h"
#include "ampx/state_dict.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch {
namespace optim {
class Optimizer;
}  // namespace optim
namespace serialize {
class InputArchive;
class OutputArchive;
}  // namespace serialize
}  // namespace torch

namespace ampx {

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
};

/// Per-optimizer stage within one iteration (PyTorch's OptState).
enum class OptState { kReady, kUnscaled, kStepped };

/// What GradScaler::step did. Converting it to bool answers "did the
/// optimizer step?"; for a ScalerAwareOptimizer that reads the found-inf flag
/// (a host sync on CUDA), which is why the result is not a plain bool.
class StepResult {
 public:
  explicit StepResult(bool stepped) : known_(stepped) {}
  explicit StepResult(at::Tensor found_inf) : found_inf_(std::move(found_inf)) {}
  /// Whether the optimizer stepped (false: skipped on inf/NaN).
  bool stepped() const;
  explicit operator bool() const { return stepped(); }
  /// float32 [] flag (1 = skipped), undefined for a plain bool result.
  const at::Tensor& found_inf() const { return found_inf_; }

 private:
  c10::optional<bool> known_;
  at::Tensor found_inf_;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// `outputs * scale`. The first call creates the scale on outputs' device.
  at::Tensor scale(const at::Tensor& outputs);
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
  void update();
  /// Sets the scale to `new_scale` instead.
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

  double get_growth_factor() const { return rule_.growth_factor; }
  void set_growth_factor(double new_factor) { rule_.growth_factor = new_factor; }
  double get_backoff_factor() const { return rule_.backoff_factor; }
  void set_backoff_factor(double new_factor) { rule_.backoff_factor = new_factor; }
  int64_t get_growth_interval() const { return rule_.growth_interval; }
  void set_growth_interval(int64_t new_interval) { rule_.growth_interval = new_interval; }
  int64_t get_hysteresis() const { return rule_.hysteresis; }
  c10::optional<double> get_min_scale() const { return rule_.min_scale; }
  c10::optional<double> get_max_scale() const { return rule_.max_scale; }
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
  void set_found_inf_hook(FoundInfHook hook) { found_inf_hook_ = std::move(hook); }

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
  void load(torch::serialize::InputArchive& archive);

 private:
  struct PerOptimizerState {
    OptState stage = OptState::kReady;
    std::unordered_map<c10::Device, at::Tensor> found_inf_per_device;
  };

  void lazy_init(const c10::Device& device);
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
};

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const GradScaler& scaler);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           GradScaler& scaler);

}  // namespace ampx
