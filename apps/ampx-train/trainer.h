#pragma once

// One training run of one precision mode: model, ampx::optim::AdamW, ampx's
// opt level, the step loop with progress and per-step metrics, checkpoints,
// a held-out evaluation, and the measurements the comparison table shows.
//
//   auto workload = make_workload(config);
//   RunResult r = train_mode(config, *workload, "O2");
//   r.items_per_s, r.peak_bytes, r.eval.loss, r.skipped, r.final_scale ...

#include "config.h"
#include "workloads.h"

#include <ampx/dist.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace ampx::train {

struct RunResult {
  std::string mode;         // fp32 | O1 | O2 | O3
  std::string dtype;        // fp32, bf16 or fp16
  int64_t steps = 0;        // steps of the whole run (resumed ones included)
  int64_t timed_steps = 0;  // steps timed in this process, after warm-up
  double items_per_s = 0;   // tokens or samples per second over the timed steps
  double median_step_ms = 0;
  int64_t peak_bytes = 0;      // most tensor bytes allocated at once while training
  double train_loss = 0;       // mean loss of the last tenth of the steps
  EvalResult eval;             // held-out loss and bpc / accuracy at the end
  int64_t skipped = 0;         // optimizer steps skipped for inf/NaN gradients
  double final_scale = 1;      // loss scale at the end (1: no scaling)
  std::vector<double> losses;  // every step's training loss
  std::vector<std::pair<int64_t, EvalResult>> evals;  // (step, result) of --eval-every
  std::string metrics_path;
  std::string checkpoint_path;  // empty when no checkpoint was written
  std::string profile_summary;  // --profile: the trace's path and top ops
};

/// A RunResult as JSON and back: how a --compare run collects the result of
/// each mode from the process that trained it.
nlohmann::json to_json(const RunResult& result);
RunResult run_result_from_json(const nlohmann::json& json);

/// Where mode `mode`'s checkpoint lives: --checkpoint-dir itself for a
/// single run, a folder per mode under it for --compare.
std::string checkpoint_path_for(const TrainConfig& config, const std::string& mode);

/// Trains `mode` from config.seed (or from its checkpoint with --resume).
/// With a process group, this process is one rank of a data-parallel run:
/// each rank trains on its slice of every (global) batch through
/// ampx::dist::DistributedDataParallel, and only rank 0 writes metrics,
/// checkpoints and progress and evaluates.
RunResult train_mode(const TrainConfig& config, Workload& workload, const std::string& mode,
                     const ampx::dist::ProcessGroup* group = nullptr);

}  // namespace ampx::train
