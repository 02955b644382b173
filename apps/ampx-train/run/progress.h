#pragma once

// What a run shows while it trains (what it leaves behind per step:
// metrics_writer.h):
//
//   Progress progress("O2", first_step, total_steps, "tok/s", Progress::Style::kBar, log_every);
//   progress.update(step, loss, scale, items_per_s);   // "[O2] step 120/300 loss 2.45 ..."

#include <chrono>
#include <cstdint>
#include <string>

namespace ampx::train {

class Progress {
 public:
  enum class Style { kBar, kLines, kNone };
  /// kBar when `requested` is "bar", or "auto" and stdout is a terminal.
  static Style style_for(const std::string& requested);

  Progress(std::string mode, int64_t first_step, int64_t total_steps, std::string rate_unit,
           Style style, int64_t log_every);
  /// After step `step` (0-based) finished.
  void update(int64_t step, double loss, double scale, double items_per_s);
  /// Ends the live line, if any.
  void finish();

 private:
  std::string line(int64_t step, double loss, double scale, double items_per_s) const;
  std::string mode_, unit_;
  int64_t first_, total_, log_every_;
  Style style_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace ampx::train
