#pragma once

// What a run shows while it trains, and what it leaves behind per step:
//
//   Progress progress("O2", first_step, total_steps, "tok/s", Progress::Style::kBar, log_every);
//   progress.update(step, loss, scale, items_per_s);   // "[O2] step 120/300 loss 2.45 ..."
//   MetricsWriter metrics(out_dir / "metrics-O2.jsonl", /*csv=*/false, resumed_step);
//   metrics.write({{"step", 120}, {"loss", 2.45}, ...});

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

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

/// Per-step metrics as JSON lines or CSV (header from the first record's
/// keys). Opened on resume, it keeps the records up to `keep_through_step`
/// and drops the rest, so the file always matches the checkpoint's history.
///
/// Every record goes to the file before write() returns; a write that fails
/// (no space left, I/O error) throws naming the path and the cause, and
/// leaves the file ending with the last whole record.
class MetricsWriter {
 public:
  MetricsWriter(std::filesystem::path path, bool csv, int64_t keep_through_step);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const nlohmann::ordered_json& record);
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  bool csv_;
  std::vector<std::string> columns_;
  int fd_ = -1;
};

}  // namespace ampx::train
