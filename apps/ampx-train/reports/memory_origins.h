#pragma once

// --memory-origins N: where each mode's peak memory came from.
//
//   result.memory_origins = mode_memory_origins(config.memory_origins, base_bytes);
//   std::cout << memory_origins_table(results);  // one table, every mode's rows

#include "run/run_result.h"

#include <ampx/memory.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ampx::train {

/// The phases of a training step that ampx-train names (ampx::CpuMemoryPhaseGuard).
inline constexpr const char* kSetUpPhase = "set-up";
inline constexpr const char* kForwardPhase = "forward";
inline constexpr const char* kLossPhase = "loss";
inline constexpr const char* kBackwardPhase = "backward";
inline constexpr const char* kOptimizerPhase = "optimizer";
/// The phase of the origin that sums those past the N largest.
inline constexpr char kOthersPhase[] = "(others)";

/// The mode's peak by origin (ampx::peak_cpu_memory_origins(), whose record
/// this stops), its blocks not recorded less the `base_bytes` allocated
/// before the mode began: the `top` largest, then the rest as one origin,
/// kOthersPhase. The bytes sum to the mode's peak_bytes (more, by what of
/// the base was freed before the peak: its part not recorded is left out
/// where it falls to zero or below).
std::vector<ampx::MemoryOrigin> mode_memory_origins(int top, int64_t base_bytes);

/// Every mode's origins in one markdown table: mode, phase, op, MiB, share
/// of the mode's peak, blocks. "" when no mode has any.
std::string memory_origins_table(const std::vector<RunResult>& results);

}  // namespace ampx::train
