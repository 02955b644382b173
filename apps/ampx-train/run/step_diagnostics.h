#pragma once

// ampx-train's numerics diagnostics around each step's forward and backward
// (--detect-nonfinite, --range-stats, --diagnose; docs/numerics.md):
//
//   StepDiagnostics diag(StepDiagnostics::Options{NonFiniteAction::kWarn, /*range_stats=*/true});
//   for (...) {
//     auto watch = diag.watch(step);  // a NonFiniteGuard and a RangeStatsCollector, this step
//     forward and backward ...
//   }                              // the step's reports and statistics fold into diag
//   diag.nonfinite_count();        // 12
//   diag.range_stats();            // every step's, merged by (scope, op, direction)
//
// The optimizer's step stays outside: its ops take the parameters, and the
// collector would count the weights and moments as the layers' activations.

#include <ampx/debug/nonfinite.h>
#include <ampx/debug/range_stats.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace ampx::train {

/// Exit status of a run that --detect-nonfinite=throw stopped.
inline constexpr int kExitNonFinite = 3;

class StepDiagnostics {
 public:
  struct Options {
    std::optional<ampx::debug::NonFiniteAction> nonfinite;  // nullopt: no guard
    bool range_stats = false;
  };
  explicit StepDiagnostics(Options options) : options_(options) {}
  StepDiagnostics(const StepDiagnostics&) = delete;
  StepDiagnostics& operator=(const StepDiagnostics&) = delete;

  bool active() const { return options_.nonfinite.has_value() || options_.range_stats; }

  /// What watches one step: alive from watch() to its destruction. With
  /// NonFiniteAction::kThrow the guard throws ampx::debug::NonFiniteError
  /// from the op that made the first inf/NaN. Reports quote `step`.
  class Watch {
   public:
    Watch(StepDiagnostics* owner, int64_t step);
    ~Watch();                 // folds what it saw into the owner
    Watch(Watch&&) = delete;  // watch() returns a prvalue: nothing moves
    Watch& operator=(Watch&&) = delete;
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;

   private:
    StepDiagnostics* owner_;
    std::unique_ptr<ampx::debug::NonFiniteGuard> guard_;
    std::unique_ptr<ampx::debug::RangeStatsCollector> collector_;
  };
  /// Nothing alive (and nothing recorded) when !active().
  [[nodiscard]] Watch watch(int64_t step) { return Watch(active() ? this : nullptr, step); }

  /// --detect-nonfinite=warn: inf/NaN outputs seen, steps that had any, and
  /// the first report (the op that made the first one).
  int64_t nonfinite_count() const { return nonfinite_count_; }
  int64_t nonfinite_steps() const { return nonfinite_steps_; }
  const std::optional<ampx::debug::NonFiniteReport>& first_report() const { return first_report_; }
  /// One line for the run's summary ("" when nothing was seen).
  std::string nonfinite_summary() const;

  /// Every watched step's statistics, records merged by (scope, op, direction)
  /// in order of first appearance.
  const ampx::debug::RangeStats& range_stats() const { return stats_; }

 private:
  void fold(const ampx::debug::NonFiniteGuard& guard);
  void fold(const ampx::debug::RangeStats& step);

  Options options_;
  int64_t nonfinite_count_ = 0;
  int64_t nonfinite_steps_ = 0;
  std::optional<ampx::debug::NonFiniteReport> first_report_;
  ampx::debug::RangeStats stats_;
};

/// What --detect-nonfinite=throw prints when it stops a run: the report and,
/// for a gradient, a word on fp16 loss scaling.
std::string nonfinite_stop_message(const ampx::debug::NonFiniteError& error);

}  // namespace ampx::train
