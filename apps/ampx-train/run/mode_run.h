#pragma once

// One mode's training run, as train_mode() (trainer.h) drives it:
//
//   ModeRun run(config, workload, "O2", group);  // the set-up (mode_run.cpp)
//   for (int64_t step = run.first_step(); step < run.total_steps(); ++step) {
//     const StepResult r = run.step(step);
//     run.record(step, r);
//     if (run.checkpoint(step, r.stop)) break;
//   }
//   RunResult result = run.finish();

#include "checkpoint.h"
#include "distributed/shard_checkpoint.h"
#include "progress.h"
#include "reports/fp8_trace.h"
#include "reports/metrics_writer.h"
#include "trainer.h"

#include <ampx/dist.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ampx::train {

/// What one step of the loop did.
struct StepResult {
  double loss = 0;                 // the global batch's
  bool stepped = true;             // false: the loss scaler skipped it
  bool stop = false;               // some rank was asked to stop after it
  double ms = 0;                   // its wall time
  std::vector<std::string> watch;  // the plan watch's findings at this step
};

/// One mode's training run, from its set-up to its result: what train_mode()'s
/// loop carries between steps, one concern per member.
class ModeRun {
 public:
  /// Sets the run up (mode_run.cpp): its identity, checkpoint rules, model
  /// and optimizer, tail, the ranks' agreement, a resume, its outputs.
  ModeRun(const TrainConfig& config, Workload& workload, const std::string& mode_name,
          const ampx::dist::ProcessGroup* group);

  int64_t first_step() const { return state_.next_step; }
  int64_t total_steps() const { return total_steps_; }

  /// Trains step `step` on this rank's rows of its batch; the ranks vote on
  /// the loss and on stopping; --profile's step is traced, the others timed.
  StepResult step(int64_t step);
  /// The step's line of the metrics, evaluation (--eval-every), FP8 trace and progress.
  void record(int64_t step, const StepResult& r);
  /// Writes the checkpoint when one is planned (--save-every, and the last
  /// step then) or a rank was asked to stop; true when the run stops here.
  bool checkpoint(int64_t step, bool stop);
  /// Timing, peak memory, the diagnostics' files and the final evaluation
  /// (none of them after a preemption).
  RunResult finish();

 private:
  // The constructor's parts, in its order (mode_run.cpp).
  /// What a checkpoint must share with the run resuming it.
  void describe_identity();
  /// Where the tail (--precision auto's plan, --fp8-tail) starts.
  void place_tail();
  /// The ranks agree on the run; DDP, the FP8 amax group and trace.
  void join_ranks();
  /// --resume: the checkpoint's state, and the layers the watch had moved.
  void resume();
  /// Rank 0's metrics file; the progress line; --profile's step.
  void open_outputs();

  EvalResult evaluate();
  /// Rank 0 evaluates; with a sharded model every rank takes part (its
  /// forward gathers the units), and rank 0's result is the one reported.
  bool evaluates() const { return lead_ || setup_.fsdp != nullptr; }

  const TrainConfig& config_;
  Workload& workload_;
  const Mode mode_;
  const ampx::dist::ProcessGroup* group_;
  const int64_t rank_, world_;
  const bool lead_;  // rank 0: writes files, shows progress, evaluates
  const torch::Device device_;
  int64_t total_steps_ = 0;
  int64_t tail_start_ = 0;   // the tail's first step (the plan's, --fp8-tail's; total_steps_: none)
  nlohmann::json identity_;  // what a checkpoint must share with the run resuming it
  std::string checkpoint_path_;
  bool may_write_checkpoint_ = false;
  int64_t base_bytes_ = 0;  // allocated before the set-up: peak memory counts from here
  ModeSetUp setup_;
  ShardIo shards_;  // --shard: what each rank's shard file holds (else empty)
  std::optional<ampx::dist::DistributedDataParallel> ddp_;
  std::optional<Fp8Trace> fp8_trace_;
  RunState state_;
  std::optional<MetricsWriter> metrics_;
  std::optional<Progress> progress_;
  StepDiagnostics diagnostics_;
  int64_t profile_step_ = -1;
  std::string profile_path_;
  std::vector<double> step_ms_;
  std::chrono::steady_clock::time_point start_;
  RunResult result_;
};

}  // namespace ampx::train
