#include "profile.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

namespace ampx::train {

struct StepProfile::Impl {
  explicit Impl(const std::string& path) : record(path) {}
  torch::autograd::profiler::RecordProfile record;
};

StepProfile::StepProfile(const std::string& path) {
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  impl_ = std::make_unique<Impl>(path);
}

StepProfile::~StepProfile() = default;

std::string summarize_trace(const std::string& path, int top) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "ampx-train: cannot read the profile '", path, "'");
  const auto trace = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(!trace.is_discarded(), "ampx-train: the profile '", path, "' is not JSON");
  const auto& events = trace.is_array() ? trace : trace.value("traceEvents", nlohmann::json());
  std::map<std::string, std::pair<int64_t, double>> by_name;  // calls, total us
  for (const auto& e : events) {
    if (e.value("ph", "") != "X") continue;
    auto& entry = by_name[e.value("name", "?")];
    entry.first += 1;
    entry.second += e.value("dur", 0.0);
  }
  std::vector<std::pair<std::string, std::pair<int64_t, double>>> rows(by_name.begin(),
                                                                       by_name.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
  std::ostringstream out;
  char line[256];
  std::snprintf(line, sizeof(line), "  %-56s %6s %10s\n", "op (inclusive time)", "calls", "ms");
  out << line;
  for (int i = 0; i < top && i < static_cast<int>(rows.size()); ++i) {
    std::snprintf(line, sizeof(line), "  %-56.56s %6lld %10.2f\n", rows[i].first.c_str(),
                  static_cast<long long>(rows[i].second.first), rows[i].second.second / 1000.0);
    out << line;
  }
  return out.str();
}

std::string profile_path_for(const std::string& path, const std::string& mode, bool per_mode) {
  if (!per_mode) return path;
  const std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + "-" + mode + p.extension().string())).string();
}

}  // namespace ampx::train
