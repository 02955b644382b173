#include "memory_origins.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace ampx::train {

std::vector<ampx::MemoryOrigin> mode_memory_origins(int top, int64_t base_bytes) {
  ampx::stop_cpu_memory_origins();
  std::vector<ampx::MemoryOrigin> all;
  for (auto& o : ampx::peak_cpu_memory_origins()) {
    // the mode's peak counts from its start
    if (o.phase == ampx::kNotRecordedPhase) o.bytes -= base_bytes;
    if (o.bytes > 0) all.push_back(std::move(o));
  }
  std::stable_sort(
      all.begin(), all.end(),
      [](const ampx::MemoryOrigin& a, const ampx::MemoryOrigin& b) { return a.bytes > b.bytes; });
  if (all.size() <= static_cast<size_t>(top)) return all;
  ampx::MemoryOrigin others{kOthersPhase, "", 0, 0};
  for (size_t i = static_cast<size_t>(top); i < all.size(); ++i) {
    others.bytes += all[i].bytes;
    others.blocks += all[i].blocks;
  }
  all.resize(static_cast<size_t>(top));
  all.push_back(others);
  return all;
}

std::string memory_origins_table(const std::vector<RunResult>& results) {
  std::ostringstream t;
  for (const auto& r : results) {
    for (const auto& o : r.memory_origins) {
      if (t.tellp() == 0) {
        t << "| mode | phase | op | MiB | of the peak | blocks |\n"
          << "| --- | --- | --- | ---: | ---: | ---: |\n";
      }
      char numbers[96];
      std::snprintf(numbers, sizeof(numbers), "%.1f | %.1f%% | %lld", o.bytes / 1048576.0,
                    r.peak_bytes > 0 ? 100.0 * o.bytes / r.peak_bytes : 0.0,
                    static_cast<long long>(o.blocks));
      t << "| " << r.mode << " | " << (o.phase.empty() ? "-" : o.phase) << " | "
        << (o.op.empty() ? "-" : o.op) << " | " << numbers << " |\n";
    }
  }
  return t.str();
}

}  // namespace ampx::train
