#include "progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <utility>

namespace ampx::train {
namespace {

std::string human_rate(double v) {
  char buf[32];
  if (v >= 1e6) {
    std::snprintf(buf, sizeof(buf), "%.2fM", v / 1e6);
  } else if (v >= 1e4) {
    std::snprintf(buf, sizeof(buf), "%.1fk", v / 1e3);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f", v);
  }
  return buf;
}

std::string clock_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "-";
  const auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", (long long)(s / 3600),
                  (long long)(s / 60 % 60), (long long)(s % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld", (long long)(s / 60), (long long)(s % 60));
  }
  return buf;
}

}  // namespace

Progress::Style Progress::style_for(const std::string& requested) {
  if (requested == "bar") return Style::kBar;
  if (requested == "lines") return Style::kLines;
  if (requested == "none") return Style::kNone;
  return ::isatty(STDOUT_FILENO) ? Style::kBar : Style::kLines;
}

Progress::Progress(std::string mode, int64_t first_step, int64_t total_steps, std::string rate_unit,
                   Style style, int64_t log_every)
    : mode_(std::move(mode)),
      unit_(std::move(rate_unit)),
      first_(first_step),
      total_(total_steps),
      log_every_(log_every > 0 ? log_every : std::max<int64_t>(1, total_steps / 20)),
      style_(style),
      start_(std::chrono::steady_clock::now()) {}

std::string Progress::line(int64_t step, double loss, double scale, double items_per_s) const {
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const int64_t done = step + 1 - first_;
  const double eta = done > 0 ? elapsed / done * static_cast<double>(total_ - step - 1) : NAN;
  char buf[200];
  std::snprintf(buf, sizeof(buf), "[%s] step %lld/%lld  loss %.4f  scale %g  %s %s  ETA %s",
                mode_.c_str(), (long long)(step + 1), (long long)total_, loss, scale,
                human_rate(items_per_s).c_str(), unit_.c_str(), clock_text(eta).c_str());
  return buf;
}

void Progress::update(int64_t step, double loss, double scale, double items_per_s) {
  if (style_ == Style::kNone) return;
  const bool last = step + 1 == total_;
  if (style_ == Style::kBar) {
    const auto now = std::chrono::steady_clock::now();
    // Redraw at most 10 times a second: a terminal is slower than a small model.
    if (!last && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    std::cout << "\r\033[K" << line(step, loss, scale, items_per_s) << std::flush;
    return;
  }
  if ((step + 1) % log_every_ == 0 || last || step == first_) {
    std::cout << line(step, loss, scale, items_per_s) << std::endl;
  }
}

void Progress::finish() {
  if (style_ == Style::kBar) std::cout << "\n" << std::flush;
}

}  // namespace ampx::train
