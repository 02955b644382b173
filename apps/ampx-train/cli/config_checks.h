#pragma once

// The combinations of ampx-train's flags that CLI11 cannot check, after
// resolve_defaults() filled in the workload's defaults:
//
//   check_combinations(config);  // throws c10::Error naming the flag and value

#include "config.h"

namespace ampx::train {

/// Checks what the device and LibTorch allow (CUDA without a device, TF32
/// off CUDA, fp16 on a 1.13 CPU), the precision plan's and the FP8 modes'
/// flags against the modes trained (and sets --plan-watch's default, 50
/// under --precision auto, else 0), then the sharding and optimizer flags.
/// Throws c10::Error naming the flag and value.
void check_combinations(TrainConfig& config);

}  // namespace ampx::train
