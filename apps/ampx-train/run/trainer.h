#pragma once

// One training run of one precision mode: model, ampx::optim::AdamW, ampx's
// opt level, the step loop with progress and per-step metrics, checkpoints,
// a held-out evaluation, and the measurements the comparison table shows.
//
//   auto workload = make_workload(config);
//   RunResult r = train_mode(config, *workload, "O2");
//   r.items_per_s, r.peak_bytes, r.eval.loss, r.skipped, r.final_scale ...

#include "cli/config.h"
#include "run_result.h"
#include "step_diagnostics.h"
#include "workloads.h"

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <ampx/fsdp.h>
#include <ampx/precision_plan.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ampx::train {

/// Where mode `mode`'s checkpoint lives: --checkpoint-dir itself for a
/// single run, a folder per mode under it for --compare.
std::string checkpoint_path_for(const TrainConfig& config, const std::string& mode);
/// Refuses to resume without a checkpoint at `checkpoint`, and (with
/// --save-every) to start a fresh run over one: c10::Error naming it.
void check_checkpoint_rules(const TrainConfig& config, const std::string& checkpoint);

/// What a mode trains: the workload's fresh model (from config.seed), its
/// ampx::optim::AdamW, and ampx's opt level over both, as the mode defines
/// them (fp32: O0; O1, O2, O3 in config.dtype; O3 without masters).
struct ModeSetUp {
  torch::nn::AnyModule net;                       // the model and its forward
  std::shared_ptr<torch::nn::Module> model;       // net.ptr()
  /// AdamW over the model's parameters (--shard full, grad: over this rank's
  /// pieces of them; optimizer: ZeRO-1's, an AdamW over this rank's shard
  /// inside). initialize() holds its address.
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  int64_t model_params = 0;  // the model's parameters' elements, whole (before any sharding)
  std::unique_ptr<ampx::AmpSession> amp;
  /// --shard full or grad: the model's wrapper (null otherwise).
  std::unique_ptr<ampx::dist::FullyShardedDataParallel> fsdp;
  /// fp8: the converted Linears (paths), and the group their amaxes are
  /// max-reduced over (data-parallel runs with delayed scaling).
  bool fp8 = false;
  std::vector<std::string> fp8_layers;
  /// FP8 modes: the Linears --bf16-layers kept in bf16 (paths).
  std::vector<std::string> bf16_layers;
  const ampx::dist::ProcessGroup* fp8_group = nullptr;
  /// --precision auto: the plan applied, as loaded (the watch's moves are
  /// in watch->plan()).
  std::optional<ampx::plan::PrecisionPlan> plan;
  /// --precision auto: the plan file's text, as read (its checkpoints keep it).
  std::string plan_text;
  /// --precision auto with --plan-watch: the plan's watch (null otherwise).
  std::unique_ptr<ampx::plan::PlanWatch> watch;
  /// In the tail (enter_tail()): the plan's Linears in its reference's
  /// format, where the watch has nothing to check; an FP8 mode's in bf16.
  bool in_tail = false;

  /// The model's output for `input` (cast to the model's dtype), in the
  /// dtype the mode's forward made it: call under amp->forward_guard(). In
  /// mode fp8, inside an FP8 region.
  torch::Tensor model_output(const torch::Tensor& input);
  /// model_output() cast to fp32 for the loss (mixed modes).
  torch::Tensor forward(const torch::Tensor& input);
};

/// The model, optimizer and AMP session of `mode`; `group`, in data-parallel
/// training, is what the plan's watch decides over (rank 0's numbers).
ModeSetUp set_up_mode(const TrainConfig& config, Workload& workload, const Mode& mode,
                      const torch::Device& device,
                      const ampx::dist::ProcessGroup* group = nullptr);

/// Enters the run's tail: under --precision auto every Linear of the plan in
/// its reference's format (ampx::plan::enter_tail); in an FP8 mode
/// (--fp8-tail) every Linear in bf16, the FP8 region closed (the converted
/// Linears and their scaling state stay, so checkpoints keep loading).
/// Sets in_tail; nothing once it is set.
void enter_tail(ModeSetUp& setup);

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
  /// The plan's watch checked this step (one more forward and backward),
  /// and what it found.
  bool watched = false;
  std::vector<ampx::plan::WatchEvent> watch_events;
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
