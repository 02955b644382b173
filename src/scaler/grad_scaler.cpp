// GradScaler's state machine. Error texts are PyTorch's (torch/amp/grad_scaler.py)
// so that users porting a Python loop meet the same messages.

#include "ampx/grad_scaler.h"

#include "ampx/kernels/loss_scale.h"

#include "scale_math.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include <cmath>

namespace ampx {

GradScaler::GradScaler(GradScalerOptions options)
    : enabled_(options.enabled()),
      rule_{options.growth_factor(), options.backoff_factor(), options.growth_interval(),
            options.hysteresis(), options.min_scale(), options.max_scale()},
      init_scale_(options.init_scale()),
      init_hysteresis_tracker_(options.hysteresis()),
      explain_skipped_steps_(options.explain_skipped_steps()),
      collapse_warning_steps_(options.collapse_warning_steps()) {
  if (!enabled_) {
    return;
  }
  // PyTorch's two assertions, verbatim, then the checks PyTorch lacks.
  TORCH_CHECK(options.growth_factor() > 1.0, "The growth factor must be > 1.0.");
  TORCH_CHECK(options.backoff_factor() < 1.0, "The backoff factor must be < 1.0.");
  TORCH_CHECK_VALUE(options.backoff_factor() > 0.0,
                    "GradScaler: backoff_factor must be > 0, got ", options.backoff_factor());
  TORCH_CHECK_VALUE(std::isfinite(options.init_scale()) && options.init_scale() > 0.0,
                    "GradScaler: init_scale must be finite and > 0, got ", options.init_scale());
  TORCH_CHECK_VALUE(options.growth_interval() > 0,
                    "GradScaler: growth_interval must be > 0, got ", options.growth_interval());
  TORCH_CHECK_VALUE(options.hysteresis() >= 1, "GradScaler: hysteresis must be >= 1, got ",
                    options.hysteresis());
  TORCH_CHECK_VALUE(options.collapse_warning_steps() >= 0,
                    "GradScaler: collapse_warning_steps must be >= 0, got ",
                    options.collapse_warning_steps());
  if (options.min_scale()) {
    TORCH_CHECK_VALUE(*options.min_scale() > 0.0, "GradScaler: min_scale must be > 0, got ",
                      *options.min_scale());
  }
  if (options.min_scale() && options.max_scale()) {
    TORCH_CHECK_VALUE(*options.min_scale() <= *options.max_scale(),
                      "GradScaler: min_scale (", *options.min_scale(),
                      ") must not exceed max_scale (", *options.max_scale(), ")");
  }
}

void GradScaler::lazy_init(const c10::Device& device) {
  TORCH_INTERNAL_ASSERT(!growth_tracker_.defined(), "_growth_tracker initialized before _scale");
  const auto on = at::TensorOptions().device(device);
  scale_ = at::full({}, init_scale_, on.dtype(at::kFloat));
  growth_tracker_ = at::full({}, init_growth_tracker_, on.dtype(at::kInt));
  hysteresis_tracker_ = at::full({}, init_hysteresis_tracker_, on.dtype(at::kInt));
}

void GradScaler::check_initialized(const char* funcname) const {
  static const char* fix =
      "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the "
      "iteration.";
  TORCH_CHECK(scale_.defined(), "Attempted ", funcname, " but _scale is None.  ", fix);
  TORCH_CHECK(growth_tracker_.defined(), "Attempted ", funcname,
              " but _growth_tracker is None.  ", fix);
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!enabled_) {
    return outputs;
  }
  TORCH_CHECK_VALUE(outputs.defined(), "GradScaler.scale: outputs is an undefined tensor");
  if (!scale_.defined()) {
    lazy_init(outputs.device());
  }
  return outputs * scale_.to(outputs.device(), /*non_blocking=*/true);
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  if (!enabled_) {
    return outputs;
  }
  std::vector<at::Tensor> scaled;
  scaled.reserve(outputs.size());
  std::unordered_map<c10::Device, at::Tensor> per_device;  // one copy per device
  for (const auto& out : outputs) {
    TORCH_CHECK_VALUE(out.defined(), "outputs must be a Tensor or an iterable of Tensors");
    if (!scale_.defined()) {
      lazy_init(out.device());
    }
    auto it = per_device.find(out.device());
    if (it == per_device.end()) {
      it = per_device.emplace(out.device(), scale_.to(out.device(), /*non_blocking=*/true)).first;
    }
    scaled.push_back(out * it->second);
  }
  return scaled;
}

std::unordered_map<c10::Device, at::Tensor> GradScaler::unscale_grads(
    torch::optim::Optimizer& optimizer, const at::Tensor& inv_scale, const at::Tensor& found_inf,
    bool allow_fp16) {
  // Gradients grouped by device, then dtype: one kernel call per group.
  std::unordered_map<c10::Device, std::unordered_map<int, std::vector<at::Tensor>>> groups;
  c10::NoGradGuard no_grad;  // grads are modified in place, outside autograd
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      if (!param.grad().defined()) {
        continue;
      }
      if (!allow_fp16 && param.grad().scalar_type() == at::kHalf) {
        TORCH_CHECK_VALUE(false, "Attempting to unscale FP16 gradients.");
      }
      at::Tensor to_unscale;
      if (param.grad().is_sparse()) {
        // fp16 sparse grads may hold duplicate indices whose sum overflows:
        // coalesce first (this replaces .grad, as in PyTorch) so the check sees it.
        if (param.grad().scalar_type() == at::kHalf) {
          param.mutable_grad() = param.grad().coalesce();
        }
        to_unscale = param.grad()._values();
      } else {
        to_unscale = param.grad();
      }
      groups[to_unscale.device()][static_cast<int>(to_unscale.scalar_type())].push_back(
          to_unscale);
    }
  }
  std::unordered_map<c10::Device, at::Tensor> per_device_found_inf;
  for (auto& device_group : groups) {
    const auto& device = device_group.first;
    auto found = found_inf.to(device, /*non_blocking=*/true, /*copy=*/true);
    const auto inv = inv_scale.to(device, /*non_blocking=*/true);
    for (auto& dtype_group : device_group.second) {
      non_finite_check_and_unscale_(dtype_group.second, found, inv);
    }
    per_device_found_inf.emplace(device, found);
  }
  return per_device_found_inf;
}

namespace {

std::vector<at::Tensor> flags_of(const std::unordered_map<c10::Device, at::Tensor>& per_device) {
  std::vector<at::Tensor> flags;
  flags.reserve(per_device.size());
  for (const auto& entry : per_device) flags.push_back(entry.second);
  return flags;
}

// The sum of found-inf flags (float32 [] each, on any device) on the
// scale's device. Every reader of the flags (the hook, a scaler-aware step,
// update) sums them here, so that all see the same number.
at::Tensor sum_found_inf(const std::vector<at::Tensor>& flags, const at::Tensor& scale) {
  auto total = at::zeros({}, scale.options());
  for (const auto& flag : flags) {
    total.add_(flag.to(scale.device(), /*non_blocking=*/true));
  }
  return total;
}

}  // namespace

void GradScaler::agree_on_found_inf(
    std::unordered_map<c10::Device, at::Tensor>& per_device) const {
  if (!found_inf_hook_) {
    return;
  }
  // One flag, one call: every rank makes the same collectives in the same
  // order however many devices its gradients are on.
  auto combined = sum_found_inf(flags_of(per_device), scale_);
  found_inf_hook_(combined);
  if (per_device.empty()) {
    return;  // no gradients: step() and update() still say so
  }
  per_device.clear();
  per_device.emplace(scale_.device(), std::move(combined));
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!enabled_) {
    return;
  }
  check_initialized("unscale_");
  auto& state = per_optimizer_[&optimizer];
  TORCH_CHECK(state.stage != OptState::kUnscaled,
              "unscale_() has already been called on this optimizer since the last update().");
  TORCH_CHECK(state.stage != OptState::kStepped, "unscale_() is being called after step().");
  const auto inv_scale = detail::inverse_scale(scale_);
  const auto found_inf = at::zeros({}, scale_.options());
  state.found_inf_per_device = unscale_grads(optimizer, inv_scale, found_inf, false);
  agree_on_found_inf(state.found_inf_per_device);
  state.stage = OptState::kUnscaled;
}

bool StepResult::stepped() const {
  return known_ ? *known_ : found_inf_.item<float>() == 0.f;
}

StepResult GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!enabled_) {
    optimizer.step();
    return StepResult(true);
  }
  check_initialized("step");
  auto& state = per_optimizer_[&optimizer];
  TORCH_CHECK(state.stage != OptState::kStepped,
              "step() has already been called since the last update().");

  if (auto* aware = dynamic_cast<ScalerAwareOptimizer*>(&optimizer)) {
    // PyTorch's _step_supports_amp_scaling path: no unscale, no host sync.
    at::Tensor grad_scale;
    if (state.stage == OptState::kReady) {
      // Check only (inv_scale 1), as PyTorch's _check_inf_per_device does.
      const auto one = at::ones({}, scale_.options());
      state.found_inf_per_device =
          unscale_grads(optimizer, one, at::zeros({}, scale_.options()), /*allow_fp16=*/true);
      agree_on_found_inf(state.found_inf_per_device);
      grad_scale = scale_;
    }
    TORCH_CHECK(!state.found_inf_per_device.empty(),
                "No inf checks were recorded for this optimizer.");
    auto found_inf = sum_found_inf(flags_of(state.found_inf_per_device), scale_);
    if (explain_skipped_steps_ && found_inf.item<float>() != 0.f) {  // opt-in host read
      explain_skipped_step(optimizer);
    }
    aware->step_scaled(grad_scale, found_inf);
    state.stage = OptState::kStepped;
    return StepResult(found_inf);
  }

  if (state.stage == OptState::kReady) {
    unscale_(optimizer);  // (unordered_map references survive the insertion)
  }
  TORCH_CHECK(!state.found_inf_per_device.empty(),
              "No inf checks were recorded for this optimizer.");
  double found = 0.0;
  for (const auto& entry : state.found_inf_per_device) {
    found += entry.second.item<double>();  // the one host sync, as in PyTorch
  }
  const bool stepped = found == 0.0;
  if (stepped) {
    optimizer.step();
  } else if (explain_skipped_steps_) {
    explain_skipped_step(optimizer);
  }
  state.stage = OptState::kStepped;
  return StepResult(stepped);
}

void GradScaler::update() {
  if (!enabled_) {
    return;
  }
  check_initialized("update");
  const auto found_infs = all_found_infs();
  TORCH_CHECK(!found_infs.empty(), "No inf checks were recorded prior to update.");
  const auto combined = sum_found_inf(found_infs, scale_);
  const auto scale_before = collapse_warning_steps_ > 0 ? scale_.clone() : at::Tensor();
  update_scale_(scale_, growth_tracker_, hysteresis_tracker_, combined, rule_);
  if (collapse_warning_steps_ > 0) {
    track_collapse(scale_before, combined);
  }
  restore_buffers(combined);
  ++updates_;
  per_optimizer_.clear();
}

std::vector<at::Tensor> GradScaler::all_found_infs() const {
  std::vector<at::Tensor> found_infs;
  for (const auto& entry : per_optimizer_) {
    const auto flags = flags_of(entry.second.found_inf_per_device);
    found_infs.insert(found_infs.end(), flags.begin(), flags.end());
  }
  return found_infs;
}

void GradScaler::finish_manual_update() {
  // No overflow rule moved the scale: a streak of overflows ends here.
  const auto found_infs = all_found_infs();
  restore_buffers(found_infs.empty() ? at::Tensor() : sum_found_inf(found_infs, scale_));
  overflow_streak_ = 0;
  scale_history_.clear();
  ++updates_;
  per_optimizer_.clear();
}

void GradScaler::update(double new_scale) {
  if (!enabled_) {
    return;
  }
  check_initialized("update");
  scale_.fill_(new_scale);
  finish_manual_update();
}

void GradScaler::update(const at::Tensor& new_scale) {
  if (!enabled_) {
    return;
  }
  check_initialized("update");
  static const char* reason =
      "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor "
      "with requires_grad=False.";
  TORCH_CHECK(new_scale.defined() && new_scale.device().type() == scale_.device().type(), reason);
  TORCH_CHECK(new_scale.numel() == 1, reason);
  TORCH_CHECK(!new_scale.requires_grad(), reason);
  scale_.copy_(new_scale.reshape({}));
  finish_manual_update();
}

double GradScaler::get_scale() const {
  if (!enabled_) {
    return 1.0;
  }
  return scale_.defined() ? scale_.item<double>() : init_scale_;
}

int64_t GradScaler::get_growth_tracker() const {
  if (!enabled_) {
    return 0;
  }
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : init_growth_tracker_;
}

int64_t GradScaler::get_hysteresis_tracker() const {
  if (!enabled_) {
    return 0;
  }
  return hysteresis_tracker_.defined() ? hysteresis_tracker_.item<int64_t>()
                                       : init_hysteresis_tracker_;
}

OptState GradScaler::stage(const torch::optim::Optimizer& optimizer) const {
  const auto it = per_optimizer_.find(&optimizer);
  return it == per_optimizer_.end() ? OptState::kReady : it->second.stage;
}

std::vector<at::Tensor> GradScaler::found_inf_per_device(
    const torch::optim::Optimizer& optimizer) const {
  std::vector<at::Tensor> out;
  const auto it = per_optimizer_.find(&optimizer);
  if (it != per_optimizer_.end()) {
    for (const auto& entry : it->second.found_inf_per_device) {
      out.push_back(entry.second);
    }
  }
  return out;
}

}  // namespace ampx
