#pragma once

// One training run of one precision mode: model, ampx::optim::AdamW, ampx's
// opt level, the step loop with progress and per-step metrics, checkpoints,
// a held-out evaluation, and the measurements the comparison table shows.
//
//   auto workload = make_workload(config);
//   RunResult r = train_mode(config, *workload, "O2");
//   r.items_per_s, r.peak_bytes, r.eval.loss, r.skipped, r.final_scale ...

#include "config.h"
#include "step_diagnostics.h"
#include "workloads.h"

#include <ampx/ampx.h>
#include <ampx/dist.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ampx::train {

struct RunResult {
  std::string mode;         // fp32 | O1 | O2 | O3
  std::string dtype;        // fp32, bf16 or fp16
  std::string blas;         // the BLAS build the training process ran on (machine.h)
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
  std::string checkpoint_path;    // empty when no checkpoint was written
  std::string profile_summary;    // --profile: the trace's path and top ops
  std::string nonfinite_summary;  // --detect-nonfinite=warn: what it saw ("" if nothing)
  std::string range_stats_path;   // --range-stats: the statistics' JSON
  std::string fp8_trace_path;     // fp8: the traced layer's amax/scale plot (or data)
  std::string weights_checksum;   // FNV-1a of the final parameters' bytes, "0x..."
  /// > 0: a preemption signal (here or on another rank) stopped the run
  /// after this many steps, and its checkpoint holds them; nothing after the
  /// last step (timing, evaluation, peak memory) is filled in.
  int64_t preempted_after = 0;
};

/// A RunResult as JSON and back: how a --compare run collects the result of
/// each mode from the process that trained it.
nlohmann::json to_json(const RunResult& result);
RunResult run_result_from_json(const nlohmann::json& json);

/// Where mode `mode`'s checkpoint lives: --checkpoint-dir itself for a
/// single run, a folder per mode under it for --compare.
std::string checkpoint_path_for(const TrainConfig& config, const std::string& mode);

/// What a mode trains: the workload's fresh model (from config.seed), its
/// ampx::optim::AdamW, and ampx's opt level over both, as the mode defines
/// them (fp32: O0; O1, O2, O3 in config.dtype; O3 without masters).
struct ModeSetUp {
  torch::nn::AnyModule net;                       // the model and its forward
  std::shared_ptr<torch::nn::Module> model;       // net.ptr()
  std::unique_ptr<ampx::optim::AdamW> optimizer;  // initialize() holds its address
  std::unique_ptr<ampx::AmpSession> amp;
  /// fp8: the converted Linears (paths), and the group their amaxes are
  /// max-reduced over (data-parallel runs with delayed scaling).
  bool fp8 = false;
  std::vector<std::string> fp8_layers;
  const ampx::dist::ProcessGroup* fp8_group = nullptr;

  /// The model's output for `input` (cast to the model's dtype), in the
  /// dtype the mode's forward made it: call under amp->forward_guard(). In
  /// mode fp8, inside an FP8 region.
  torch::Tensor model_output(const torch::Tensor& input);
  /// model_output() cast to fp32 for the loss (mixed modes).
  torch::Tensor forward(const torch::Tensor& input);
};

ModeSetUp set_up_mode(const TrainConfig& config, Workload& workload, const Mode& mode,
                      const torch::Device& device);

/// One optimizer step of `setup` on `batch` (this rank's rows of it): the
/// forward under the mode's guard, the scaled backward, the gradients
/// averaged over `ddp`'s ranks, the scaler's step and update. Returns the
/// loss (this rank's) and whether the optimizer stepped (false: inf/NaN
/// gradients, skipped). `diagnostics` watches the forward and the backward
/// (not the optimizer's step), its reports quoting batch.step; the loss runs
/// in the scope "loss".
struct StepOutcome {
  torch::Tensor loss;
  bool stepped = true;
};
StepOutcome train_step(ModeSetUp& setup, Workload& workload, const Batch& batch,
                       ampx::dist::DistributedDataParallel* ddp = nullptr,
                       StepDiagnostics* diagnostics = nullptr);

/// What --detect-nonfinite and --range-stats ask train_mode to watch.
StepDiagnostics::Options diagnostics_options(const TrainConfig& config);

/// Trains `mode` from config.seed (or from its checkpoint with --resume).
/// After SIGTERM or SIGUSR1 (preemption.h) it finishes the current step,
/// writes the checkpoint and returns with `preempted_after` set.
/// With a process group, this process is one rank of a data-parallel run:
/// each rank trains on its slice of every (global) batch through
/// ampx::dist::DistributedDataParallel, and only rank 0 writes metrics,
/// checkpoints and progress and evaluates.
RunResult train_mode(const TrainConfig& config, Workload& workload, const std::string& mode,
                     const ampx::dist::ProcessGroup* group = nullptr);

}  // namespace ampx::train
