#include "step_diagnostics.h"

#include <sstream>
#include <utility>

namespace ampx::train {

namespace debug = ampx::debug;

StepDiagnostics::Watch::Watch(StepDiagnostics* owner, int64_t step) : owner_(owner) {
  if (!owner_) return;
  if (owner_->options_.nonfinite) {
    // kWarn: the first report of a step is warned (later ones mostly carry
    // it on); count() still counts every one.
    guard_ = std::make_unique<debug::NonFiniteGuard>(
        debug::NonFiniteOptions().action(*owner_->options_.nonfinite).max_reports(1).step(step));
  }
  if (owner_->options_.range_stats) collector_ = std::make_unique<debug::RangeStatsCollector>();
}

StepDiagnostics::Watch::~Watch() {
  if (!owner_) return;
  // Unwinding from a NonFiniteError too: the guard goes, the owner keeps
  // what it counted so far.
  if (collector_) {
    owner_->fold(collector_->stats());
    collector_.reset();
  }
  if (guard_) {
    owner_->fold(*guard_);
    guard_.reset();
  }
}

void StepDiagnostics::fold(const debug::NonFiniteGuard& guard) {
  if (guard.count() == 0) return;
  nonfinite_count_ += guard.count();
  ++nonfinite_steps_;
  if (!first_report_ && !guard.reports().empty()) first_report_ = guard.reports().front();
}

void StepDiagnostics::fold(const debug::RangeStats& step) {
  stats_.merge(step);
}

std::string StepDiagnostics::nonfinite_summary() const {
  if (nonfinite_count_ == 0) return "";
  std::ostringstream s;
  s << "--detect-nonfinite=warn: " << nonfinite_count_ << " non-finite op output"
    << (nonfinite_count_ == 1 ? "" : "s") << " in " << nonfinite_steps_ << " step"
    << (nonfinite_steps_ == 1 ? "" : "s");
  if (first_report_) s << "; the first: " << first_report_->message();
  return s.str();
}

std::string nonfinite_stop_message(const debug::NonFiniteError& error) {
  const auto& r = error.report();
  std::string text = "ampx-train: --detect-nonfinite stopped the run: " + r.message();
  if (r.direction == debug::Direction::kBackward) {
    text +=
        "\n(With fp16, the loss scaler starts at 65536 and lets gradients overflow on purpose "
        "until it has backed off to a scale that fits; --detect-nonfinite=warn reports them "
        "and trains on.)";
  }
  text +=
      "\nNothing was saved for this step; a checkpoint written before it (--save-every) is intact.";
  return text;
}

}  // namespace ampx::train
