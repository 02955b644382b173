#pragma once

// One-pass scans of a floating tensor's values: non-finite counts for the
// NonFiniteGuard, the full range record for the statistics. CPU tensors are
// scanned in place (in parallel); others are copied to the host first.

#include "ampx/debug/range_stats.h"

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ampx {
namespace debug {
namespace detail {

struct FiniteScan {
  int64_t nan = 0;
  int64_t inf = 0;
  double abs_max = 0;      // over the finite values
  int64_t first_bad = -1;  // flat (row-major) index of the first inf/NaN
  double first_value = 0;
};

/// Counts only (abs_max 0, first_bad -1) unless something is non-finite or
/// `full` is set: the fast path of every check.
FiniteScan scan_finite(const at::Tensor& values, bool full = true);

}  // namespace detail
}  // namespace debug
}  // namespace ampx
