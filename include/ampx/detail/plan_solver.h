#pragma once

/// \file
/// The exact solver under ampx::plan::make_plan (ampx/plan/solve.h), public
/// for its tests.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ampx {
namespace plan {

/// The solver's core: picks one option per group,
/// minimising the summed cost with the summed (non-negative) weights <=
/// capacity; returns the chosen index per group. weights[g][i] and
/// costs[g][i] describe option i of group g. c10::Error when nothing fits.
std::vector<size_t> solve_multiple_choice(const std::vector<std::vector<double>>& weights,
                                          const std::vector<std::vector<double>>& costs,
                                          double capacity, int64_t steps);

}  // namespace plan
}  // namespace ampx
