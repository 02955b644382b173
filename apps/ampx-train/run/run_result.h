#pragma once

// What one mode's training run measured, and its JSON form: how a --compare
// run collects each mode's result from the process that trained it.
//
//   write_output_file(path, to_json(result).dump() + "\n");
//   RunResult back = run_result_from_json(nlohmann::json::parse(text));

#include "workloads.h"

#include <ampx/memory.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ampx::train {

struct RunResult {
  std::string mode;         // fp32 | O1 | O2 | O3
  std::string dtype;        // fp32, bf16 or fp16
  std::string blas;         // the BLAS build the training process ran on (machine.h)
  /// 16-bit CPU products: cpu_products_used() (machine.h); "" for fp32 and GPUs.
  std::string cpu_products;
  int64_t steps = 0;        // steps of the whole run (resumed ones included)
  int64_t timed_steps = 0;  // steps timed in this process, after warm-up
  double items_per_s = 0;   // tokens or samples per second over the timed steps
  double median_step_ms = 0;
  /// Most tensor bytes allocated at once while training (ranks: the largest).
  int64_t peak_bytes = 0;
  std::vector<int64_t> rank_peak_bytes;  // data-parallel runs: each rank's, in rank order
  /// What the optimizer keeps (masters, compensations, moments, scales;
  /// sharded runs: rank 0's share), and the model's parameter count.
  int64_t optimizer_bytes = 0;
  int64_t params = 0;
  /// The model's parameters and gradients after the last step (rank 0's;
  /// --shard grad/full: its fp32 shards and their gradients).
  int64_t weight_bytes = 0;
  /// --shard grad/full: the most bytes of gathered parameters rank 0 held at once.
  int64_t gathered_bytes = 0;
  /// --memory-origins N: peak_bytes by origin, its N largest and then the
  /// rest as one (reports/memory_origins.h).
  std::vector<ampx::MemoryOrigin> memory_origins;
  double train_loss = 0;       // mean loss of the last tenth of the steps
  EvalResult eval;             // held-out loss and bpc / accuracy at the end
  int64_t skipped = 0;         // optimizer steps skipped for inf/NaN gradients
  double final_scale = 1;      // loss scale at the end (1: no scaling)
  std::vector<double> losses;  // every step's training loss
  std::vector<std::pair<int64_t, EvalResult>> evals;  // (step, result) of --eval-every
  std::string metrics_path;
  std::string checkpoint_path;    // empty when no checkpoint was written
  std::string weights_path;       // --export-weights: the safetensors file written
  std::string profile_summary;    // --profile: the trace's path and top ops
  std::string nonfinite_summary;  // --detect-nonfinite=warn: what it saw ("" if nothing)
  std::string range_stats_path;   // --range-stats: the statistics' JSON
  std::string fp8_trace_path;     // fp8: the traced layer's amax/scale plot (or data)
  std::string weights_checksum;   // FNV-1a of the final parameters' bytes, "0x..."
  /// --precision auto: the plan watch's findings, one line each, and the
  /// plan as the watch left it when it moved a layer (--plan-widen).
  std::vector<std::string> plan_watch;
  std::string watched_plan_path;
  /// The first step of the tail (--precision auto: the plan's, every Linear
  /// in its reference's format to the end; FP8 modes: --fp8-tail's, every
  /// Linear in bf16); -1: none.
  int64_t tail_start = -1;
  /// > 0: a preemption signal (here or on another rank) stopped the run
  /// after this many steps, and its checkpoint holds them; nothing after the
  /// last step (timing, evaluation, peak memory) is filled in.
  int64_t preempted_after = 0;
};

/// What the optimizer kept per parameter of the model (0 without a count).
inline double optimizer_bytes_per_param(const RunResult& r) {
  return r.params > 0 ? double(r.optimizer_bytes) / double(r.params) : 0.0;
}

/// --memory-origins' origins as JSON, as RunResult's JSON and compare.json
/// write them: [{"phase", "op", "bytes", "blocks"}, ...].
nlohmann::json memory_origins_json(const std::vector<ampx::MemoryOrigin>& origins);

/// A RunResult as JSON and back (the fields from `mode` to `weights_path`;
/// the console-only ones stay behind). NaN losses travel as null.
nlohmann::json to_json(const RunResult& result);
RunResult run_result_from_json(const nlohmann::json& json);

/// Throughput over the steps after warm-up (the first steps pay for lazy
/// initialisation in oneDNN, the allocator and the optimizer's state):
/// timed_steps, items_per_s and median_step_ms of `result` from every
/// step's wall time `step_ms`.
void summarize_timing(const Workload& workload, const std::vector<double>& step_ms,
                      RunResult& result);

}  // namespace ampx::train
