#pragma once

// Which ranks hold which value of a setting, for messages that name the
// ranks that disagree (DistributedDataParallel's model check, ampx-train's
// settings agreement). Header-only: ampx-train uses it too.
//
//   ranks_by_value({"O2", "O1", "O2"});  // {{"O2", "0, 2"}, {"O1", "1"}}

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace ampx {
namespace detail {

/// Each distinct value of `by_rank` (rank r's at r), in order of first
/// appearance, with its ranks: "0, 2".
inline std::vector<std::pair<std::string, std::string>> ranks_by_value(
    const std::vector<std::string>& by_rank) {
  std::vector<std::pair<std::string, std::string>> seen;
  for (size_t r = 0; r < by_rank.size(); ++r) {
    auto at = std::find_if(seen.begin(), seen.end(),
                           [&](const auto& s) { return s.first == by_rank[r]; });
    if (at == seen.end()) {
      seen.emplace_back(by_rank[r], std::to_string(r));
    } else {
      at->second += ", " + std::to_string(r);
    }
  }
  return seen;
}

}  // namespace detail
}  // namespace ampx
