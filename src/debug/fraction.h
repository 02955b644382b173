#pragma once

// part / whole as a fraction, 0 for an empty whole: the share of a range
// record's values that overflow, flush to zero or are subnormal, for
// RangeRecord (range_stats.cpp) and the advisor (advisor.cpp) alike.

#include <cstdint>

namespace ampx {
namespace debug {
namespace detail {

inline double fraction(int64_t part, int64_t whole) {
  return whole > 0 ? static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

}  // namespace detail
}  // namespace debug
}  // namespace ampx
