#pragma once

// What a run leaves behind per step: one record a line, JSON or CSV.
//
//   MetricsWriter metrics(out_dir / "metrics-O2.jsonl", /*csv=*/false, resumed_step);
//   metrics.write({{"step", 120}, {"loss", 2.45}, ...});

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace ampx::train {

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
