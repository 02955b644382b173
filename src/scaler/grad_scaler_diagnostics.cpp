// GradScaler's opt-in diagnostics: which gradients overflowed on a skipped
// step, a warning when the scale collapses, and module buffers kept as they
// were before a skipped step. Each costs nothing unless asked for.

#include "ampx/grad_scaler.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <sstream>

namespace ampx {
namespace {

constexpr size_t kNamesShown = 8;    // per warning line, then "and N more"
constexpr size_t kScalesShown = 17;  // in the collapse warning, then "... "

std::string default_name(size_t group, size_t index) {
  std::ostringstream out;
  out << "param_groups[" << group << "].params[" << index << "]";
  return out.str();
}

}  // namespace

std::string SkippedStep::to_string() const {
  std::ostringstream out;
  out << "skipped step at iteration " << iteration << " (scale " << scale << "): ";
  if (grads.empty()) {
    out << "none of the optimizer's " << num_grads
        << " gradients holds inf/NaN: the found-inf hook flagged the step (another rank's "
           "gradients overflowed)";
    return out.str();
  }
  out << grads.size() << " of " << num_grads << " gradients hold inf/NaN: ";
  for (size_t i = 0; i < grads.size() && i < kNamesShown; ++i) {
    const auto& g = grads[i];
    out << (i ? ", " : "") << g.name << " " << c10::IntArrayRef(g.sizes) << " "
        << c10::toString(g.dtype) << " (" << g.non_finite << " non-finite)";
  }
  if (grads.size() > kNamesShown) {
    out << ", and " << grads.size() - kNamesShown << " more";
  }
  return out.str();
}

void GradScaler::name_parameters(
    const torch::OrderedDict<std::string, at::Tensor>& named_parameters) {
  for (auto it = parameter_names_.begin(); it != parameter_names_.end();) {
    it = it->second.param.expired() ? parameter_names_.erase(it) : std::next(it);
  }
  for (const auto& item : named_parameters) {
    const auto& param = item.value();
    if (param.defined()) {
      parameter_names_.insert_or_assign(
          param.unsafeGetTensorImpl(),
          NamedParameter{item.key(),
                         c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(
                             param.getIntrusivePtr())});
    }
  }
}

c10::optional<SkippedStep> GradScaler::last_skipped_step() const {
  if (skipped_steps_.empty()) {
    return c10::nullopt;
  }
  return skipped_steps_.back();
}

void GradScaler::explain_skipped_step(const torch::optim::Optimizer& optimizer) {
  SkippedStep skipped{updates_, scale_.item<double>(), 0, {}};
  c10::NoGradGuard no_grad;
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& grad = params[i].grad();
      if (!grad.defined()) {
        continue;
      }
      ++skipped.num_grads;
      // Unscaled or not (unscale_ may have run), inf/NaN stays inf/NaN.
      const auto values = grad.is_sparse() ? grad._values() : grad;
      const int64_t non_finite = values.numel() - at::isfinite(values).sum().item<int64_t>();
      if (non_finite == 0) {
        continue;
      }
      const auto named = parameter_names_.find(params[i].unsafeGetTensorImpl());
      const bool has_name = named != parameter_names_.end() && !named->second.param.expired();
      skipped.grads.push_back({has_name ? named->second.name : default_name(g, i),
                               grad.sizes().vec(), grad.scalar_type(), non_finite});
    }
  }
  TORCH_WARN("GradScaler: ", skipped.to_string());
  skipped_steps_.push_back(std::move(skipped));
  if (skipped_steps_.size() > kSkippedStepHistory) {
    skipped_steps_.pop_front();
  }
}

bool GradScaler::scale_collapsed() const {
  return collapse_warning_steps_ > 0 && overflow_streak_ >= collapse_warning_steps_;
}

void GradScaler::track_collapse(const at::Tensor& scale_before, const at::Tensor& found_inf) {
  // float32 [] each, on the scale's device: one host read for the three.
  const auto host = at::stack({scale_before, scale_, found_inf}).to(at::kCPU, at::kDouble);
  const double* v = host.data_ptr<double>();
  if (v[2] == 0.0) {
    overflow_streak_ = 0;
    scale_history_.clear();
    return;
  }
  if (overflow_streak_ == 0) {
    scale_history_.push_back(v[0]);  // where the fall started
  }
  scale_history_.push_back(v[1]);
  if (scale_history_.size() > kScalesShown) {
    scale_history_.pop_front();
  }
  ++overflow_streak_;
  if (overflow_streak_ < collapse_warning_steps_ || collapse_warned_) {
    return;
  }
  collapse_warned_ = true;
  std::ostringstream history;
  if (static_cast<size_t>(overflow_streak_) + 1 > scale_history_.size()) {
    history << "... -> ";
  }
  for (size_t i = 0; i < scale_history_.size(); ++i) {
    history << (i ? " -> " : "") << scale_history_[i];
  }
  const bool at_floor = rule_.min_scale && v[1] <= *rule_.min_scale;
  TORCH_WARN("loss scale collapsed: the last ", overflow_streak_,
             " update() calls all found inf/NaN gradients and skipped their steps; the scale "
             "went ",
             history.str(), at_floor ? " (min_scale)" : "",
             ". Gradients that overflow at every scale come from inf/NaN in the forward pass: "
             "find the first op that makes one with ampx::debug::NonFiniteGuard, or train in "
             "bfloat16, whose range is float32's.");
}

void GradScaler::protect_buffers(const torch::nn::Module& module) {
  if (!enabled_) {
    return;
  }
  c10::NoGradGuard no_grad;
  for (const auto& buffer : module.buffers(/*recurse=*/true)) {
    if (!buffer.defined()) {
      continue;
    }
    bool known = false;
    for (const auto& entry : protected_buffers_) known = known || entry.buffer.is_same(buffer);
    if (!known) {
      protected_buffers_.push_back({buffer, buffer.detach().clone()});
    }
  }
}

void GradScaler::restore_buffers(const at::Tensor& found_inf) {
  if (protected_buffers_.empty()) {
    return;
  }
  c10::NoGradGuard no_grad;
  std::unordered_map<c10::Device, at::Tensor> skipped;  // bool [] per buffer device
  for (auto& entry : protected_buffers_) {
    auto& buffer = entry.buffer;
    auto& snapshot = entry.snapshot;
    const bool same_layout = snapshot.device() == buffer.device() &&
                             snapshot.scalar_type() == buffer.scalar_type() &&
                             snapshot.sizes() == buffer.sizes();
    if (!found_inf.defined() || !same_layout) {
      snapshot = buffer.detach().clone();  // moved or replaced: nothing to restore from
      continue;
    }
    auto flag = skipped.find(buffer.device());
    if (flag == skipped.end()) {
      flag = skipped.emplace(buffer.device(), found_inf.to(buffer.device()).gt(0)).first;
    }
    // where() selects, so ints and floats come back bit for bit and nothing
    // of a poisoned value leaks through (a lerp or a multiply would).
    at::where_out(snapshot, flag->second, snapshot, buffer);
    buffer.copy_(snapshot);
  }
}

}  // namespace ampx
