#include "trainer.h"

#include "auto_precision.h"
#include "checkpoint.h"
#include "device_memory.h"
#include "fp8_trace.h"
#include "machine.h"
#include "metrics_writer.h"
#include "optimizer_options.h"
#include "output_file.h"
#include "preemption.h"
#include "profile.h"
#include "progress.h"
#include "rank_agreement.h"
#include "report.h"
#include "shard_checkpoint.h"
#include "sharding.h"
#include "weights_export.h"

#include <ampx/ampx.h>
#include <ampx/debug/nonfinite.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <numeric>
#include <optional>

namespace ampx::train {
namespace {

namespace fs = std::filesystem;

}  // namespace

std::string checkpoint_path_for(const TrainConfig& config, const std::string& mode) {
  fs::path dir = config.checkpoint_dir;
  if (!config.compare.empty()) dir /= mode;
  return (dir / "checkpoint.ampx").string();
}

void check_checkpoint_rules(const TrainConfig& config, const std::string& ckpt) {
  if (config.resume) {
    TORCH_CHECK(fs::exists(ckpt), "ampx-train: --resume, but there is no checkpoint at '", ckpt,
                "' (--checkpoint-dir ", config.checkpoint_dir, ")");
  } else if (config.save_every > 0) {
    // Never overwrite a run the user may want back.
    TORCH_CHECK(!fs::exists(ckpt), "ampx-train: '", ckpt,
                "' already holds a checkpoint; pass --resume to continue it, or choose another "
                "--checkpoint-dir");
  }
}

namespace {

/// This rank's rows of the global batch.
Batch rank_rows(Batch batch, int64_t rank, int64_t world) {
  if (world == 1) return batch;
  const int64_t rows = batch.input.size(0) / world;
  batch.input = batch.input.slice(0, rank * rows, (rank + 1) * rows);
  batch.target = batch.target.slice(0, rank * rows, (rank + 1) * rows);
  return batch;
}

/// One line of the metrics file.
nlohmann::ordered_json step_record(const TrainConfig& config, const Workload& workload,
                                   const std::string& mode, int64_t step, double loss, double scale,
                                   bool stepped, double ms, double elapsed_s) {
  return {
      {"mode", mode},
      {"step", step},
      {"epoch", static_cast<double>(step + 1) / workload.steps_per_epoch()},
      {"loss", loss},
      {"scale", scale},
      {"skipped", !stepped},
      {"lr", config.lr},
      {"step_ms", ms},
      {workload.unit() + "_per_s", workload.items_per_step() * 1000.0 / ms},
      {"elapsed_s", elapsed_s},
  };
}

/// The ranks' agreement after a step, carried by the one all-reduce the loss
/// needs anyway: the global batch's loss (the mean of the ranks' means) and
/// whether any rank was asked to stop (a preemption signal, preemption.h).
struct StepVote {
  double loss = 0;
  bool stop = false;
};

StepVote vote_after_step(const ampx::dist::ProcessGroup* group, const torch::Tensor& loss,
                         bool stop) {
  if (group == nullptr) return {loss.item<double>(), stop};  // .item() waits for the device
  const auto local = loss.detach().to(torch::kFloat).reshape({1});
  auto both = torch::cat({local, torch::full({1}, stop ? 1.0 : 0.0, local.options())});
  group->all_reduce_sum(both);
  const auto mean = both.slice(0, 0, 1) / static_cast<double>(group->world_size());
  return {mean.item<double>(), both[1].item<float>() > 0};
}

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
  int64_t tail_start_ = 0;  // the tail's first step (the plan's, --fp8-tail's; total_steps_: none)
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

ModeRun::ModeRun(const TrainConfig& config, Workload& workload, const std::string& mode_name,
                 const ampx::dist::ProcessGroup* group)
    : config_(config),
      workload_(workload),
      mode_(parse_mode(mode_name, config)),
      group_(group),
      rank_(group ? group->rank() : 0),
      world_(group ? group->world_size() : 1),
      lead_(rank_ == 0),
      device_(config.torch_device()),
      diagnostics_(diagnostics_options(config)) {
  TORCH_CHECK(config.batch_size % world_ == 0, "ampx-train: --batch-size ", config.batch_size,
              " (the global batch) must be divisible by the ", world_, " processes");
  result_.mode = mode_.name;
  result_.dtype = mode_.dtype_name();
  result_.blas = blas_library();
  if (config.device == "cpu" && mode_.mixed()) {
    result_.cpu_products = cpu_products_used(mode_.dtype);
  }
  total_steps_ =
      config.steps > 0
          ? config.steps
          : std::max<int64_t>(
                1, static_cast<int64_t>(std::ceil(config.epochs * workload.steps_per_epoch())));
  result_.steps = total_steps_;

  identity_ = workload.identity();
  identity_["precision"] = mode_.name;
  identity_["dtype"] = result_.dtype;
  identity_["device"] = config.device;
  identity_["steps_per_epoch"] = workload.steps_per_epoch();
  if (mode_.name == "auto") {
    identity_["fp8_recipe"] = "plan";
  } else if (mode_.fp8) {
    identity_["fp8_recipe"] = fp8_recipe_of(config, mode_.name).to_string();
  }

  checkpoint_path_ = checkpoint_path_for(config, mode_.name);
  from_rank0(group, [&] {  // rank 0 alone writes and reads checkpoints
    check_checkpoint_rules(config, checkpoint_path_);
    return std::string();
  });
  // A preemption checkpoint never replaces one this run neither resumed nor writes anyway.
  may_write_checkpoint_ = config.resume || config.save_every > 0 || !fs::exists(checkpoint_path_);

  base_bytes_ = allocated_bytes(device_);
  reset_peak_memory(device_);
  setup_ = set_up_mode(config, workload, mode_, device_, group);
  shards_ = shard_io(config, setup_);
  tail_start_ = total_steps_;
  if (setup_.plan) {  // a checkpoint resumes under the plan it trained with
    for (const auto& l : setup_.plan->layers) {
      identity_["plan"][l.module] = ampx::plan::to_string(l.format);
    }
    identity_["plan_target"] = setup_.plan->target;
    identity_["plan_tail"] = setup_.plan->tail;
    tail_start_ = ampx::plan::tail_start(*setup_.plan, total_steps_);
  } else if (setup_.fp8) {
    ampx::plan::PrecisionPlan fixed;  // no layers: its tail placed as a plan's
    fixed.tail = parse_tail(config.fp8_tail, "--fp8-tail");
    identity_["fp8_tail"] = fixed.tail;
    tail_start_ = ampx::plan::tail_start(fixed, total_steps_);
  }
  const bool some_tail =
      setup_.plan ? setup_.plan->tail > 0 : setup_.fp8 && identity_["fp8_tail"].get<double>() > 0;
  if (some_tail && tail_start_ == total_steps_ && total_steps_ > 0 && lead_) {
    std::cout << "[" << mode_.name << "] ";
    if (setup_.plan) {
      std::cout << "the plan's tail " << setup_.plan->tail;
    } else {
      std::cout << "--fp8-tail " << config.fp8_tail;
    }
    std::cout << " of " << total_steps_ << " steps rounds to no step: it trains without one"
              << std::endl;
  }
  TORCH_CHECK(tail_start_ > 0 || tail_start_ == total_steps_, "ampx-train: ",
              setup_.plan ? "the plan's tail (" + std::to_string(setup_.plan->tail) + ")"
                          : "--fp8-tail " + config.fp8_tail,
              " covers every one of the run's ", total_steps_,
              " steps, which would then all train with every Linear in ", result_.dtype,
              "; give a smaller share or more --steps");
  result_.tail_start = tail_start_ < total_steps_ ? tail_start_ : -1;
  // Before DDP's broadcast of the parameters: a rank started with another
  // model shape or precision fails here, on every rank, naming the difference.
  if (group) {
    nlohmann::json identity = identity_;
    if (setup_.plan) {  // and the plan's watch: its steps and settings
      identity["plan_watch"] = config.plan_watch;
      identity["plan_widen"] = config.plan_widen;
      identity["plan_noise_ratio"] = config.plan_noise_ratio;
    }
    check_ranks_agree(*group, run_fingerprint(identity, *setup_.model, total_steps_));
  }
  // After the cast: the broadcast and the buckets see the training dtypes.
  // (--shard: the wrapper or ZeRO-1 reduces the gradients instead.)
  if (group && config.shard == "none") ddp_.emplace(setup_.model, *group);
  // TE's reduce_amax: the same scales on every rank, so the ranks stay bitwise.
  const bool tensorwise =
      setup_.fp8 && mode_.name != "auto" && !fp8_recipe_of(config, mode_.name).is_block();
  if (group && tensorwise && fp8_recipe_of(config, mode_.name).is_delayed()) {
    setup_.fp8_group = group;
  }
  if (tensorwise && lead_) {
    fp8_trace_.emplace(config.fp8_trace_layer, *setup_.model, setup_.fp8_layers);
  }

  if (config.resume) {
    const std::string bytes =
        from_rank0(group, [&] { return read_checkpoint_bytes(checkpoint_path_); });
    state_ = shards_.load ? load_sharded_checkpoint(checkpoint_path_, bytes, identity_, shards_,
                                                    *setup_.amp, *group)
                          : load_checkpoint(checkpoint_path_, bytes, identity_,
                                            {*setup_.model, *setup_.optimizer, *setup_.amp});
    TORCH_CHECK(state_.next_step <= total_steps_, "ampx-train: checkpoint '", checkpoint_path_,
                "' is at step ", state_.next_step, ", past this run's ", total_steps_,
                " steps; raise --steps");
    if (!state_.plan_formats.empty()) {  // the layers the watch had moved, moved again
      TORCH_CHECK(setup_.watch && config.plan_widen, "ampx-train: checkpoint '",
                  checkpoint_path_,
                  "' holds layers the plan watch moved to wider formats; resume it with the "
                  "watch (--plan-watch N --plan-widen) so that they train in those formats");
      std::map<std::string, ampx::plan::LayerFormat> formats;
      for (const auto& [module, format] : state_.plan_formats) {
        formats[module] = ampx::plan::parse_layer_format(format, "plan_formats");
      }
      setup_.watch->restore(formats);
    }
  }
  state_.plan_file = setup_.plan_text;  // this run's plan, which its checkpoints keep

  if (lead_) {
    fs::create_directories(config.out_dir);
    const bool csv = config.metrics_format == "csv";
    metrics_.emplace(
        fs::path(config.out_dir) / ("metrics-" + mode_.name + (csv ? ".csv" : ".jsonl")), csv,
        config.resume ? state_.next_step - 1 : -1);
    result_.metrics_path = metrics_->path().string();
  }
  progress_.emplace(mode_.name, state_.next_step, total_steps_, workload.unit() + "/s",
                    lead_ ? Progress::style_for(config.progress) : Progress::Style::kNone,
                    config.log_every);
  // --profile: one step after warm-up, left out of the timing (the profiler slows it).
  if (!config.profile.empty() && lead_) {
    profile_step_ = state_.next_step + std::min<int64_t>(10, (total_steps_ - state_.next_step) / 2);
    profile_path_ = profile_path_for(config.profile, mode_.name, !config.compare.empty());
  }
  start_ = std::chrono::steady_clock::now();
}

StepResult ModeRun::step(int64_t step) {
  std::optional<StepProfile> profile;
  if (step == profile_step_) profile.emplace(profile_path_);
  const auto t0 = std::chrono::steady_clock::now();
  const Batch batch = rank_rows(workload_.batch(step, device_), rank_, world_);
  if (!setup_.in_tail && step >= tail_start_) {  // also where a resume starts
    enter_tail(setup_);
    if (lead_) {
      // A bf16 reference's layers run under the mode's autocast (fp16 on CUDA by default).
      const bool wide =
          setup_.plan && setup_.plan->reference == ampx::plan::LayerFormat::kFloat32;
      std::cout << "\n[" << mode_.name << "] " << (setup_.plan ? "plan tail" : "fp8 tail")
                << ": steps " << tail_start_ << "-" << total_steps_ - 1 << " with every "
                << (setup_.plan ? "planned " : "") << "Linear in "
                << (wide ? std::string("fp32") : result_.dtype) << std::endl;
    }
  }
  StepOutcome outcome;
  try {
    outcome = train_step(setup_, workload_, batch, ddp_ ? &*ddp_ : nullptr, &diagnostics_);
  } catch (const ampx::debug::NonFiniteError&) {
    progress_->finish();  // the live line ends before main prints the report
    throw;
  }
  const StepVote vote = vote_after_step(group_, outcome.loss, preemption_signal() != 0);
  StepResult r{
      vote.loss, outcome.stepped, vote.stop,
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(),
      {}};
  for (const auto& e : outcome.watch_events) {
    r.watch.push_back(e.message());
    result_.plan_watch.push_back(r.watch.back());
    if (lead_) std::cout << "\n[" << mode_.name << "] plan watch: " << r.watch.back() << std::endl;
  }
  if (profile) {
    profile.reset();  // writes the trace
    result_.profile_summary = "[" + mode_.name + "] profile of step " + std::to_string(step + 1) +
                              " (" + std::to_string(r.ms) +
                              " ms with the profiler on): " + profile_path_ + "\n" +
                              summarize_trace(profile_path_, 15);
  } else if (!outcome.watched) {  // a watched step ran twice: left out of the timing too
    step_ms_.push_back(r.ms);
  }
  if (!r.stepped) ++state_.skipped;
  state_.losses.push_back(r.loss);
  state_.next_step = step + 1;
  return r;
}

void ModeRun::record(int64_t step, const StepResult& r) {
  const double scale = setup_.amp->scaler().is_enabled() ? setup_.amp->scaler().get_scale() : 1.0;
  nlohmann::ordered_json record =
      step_record(config_, workload_, mode_.name, step, r.loss, scale, r.stepped, r.ms,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  if (evaluates() && config_.eval_every > 0 && (step + 1) % config_.eval_every == 0 &&
      step + 1 < total_steps_) {
    const EvalResult e = evaluate();
    result_.evals.emplace_back(step + 1, e);
    record["eval_loss"] = e.loss;
    record["eval_" + workload_.metric_name()] = e.metric;
  }
  if (!r.watch.empty()) record["plan_watch"] = r.watch;
  if (fp8_trace_ && !setup_.in_tail) fp8_trace_->add(step, record);  // the tail: no FP8
  if (metrics_) metrics_->write(record);
  progress_->update(step, r.loss, scale, workload_.items_per_step() * 1000.0 / r.ms);
}

bool ModeRun::checkpoint(int64_t step, bool stop) {
  const bool last = step + 1 == total_steps_;
  const bool planned = config_.save_every > 0 && ((step + 1) % config_.save_every == 0 || last);
  stop = stop && !last;  // after the last step: the run ends as planned
  if (!planned && !stop) return false;
  TORCH_CHECK(planned || may_write_checkpoint_, "ampx-train: ", signal_name(preemption_signal()),
              " asked to stop after step ", step + 1, ", but '", checkpoint_path_,
              "' holds a checkpoint this run did not write; it stays as it is, and the steps "
              "of this run are lost (pass --save-every or another --checkpoint-dir)");
  if (setup_.watch && setup_.watch->moved()) {  // --plan-widen: where the layers now are
    for (const auto& l : setup_.watch->plan().layers) {
      state_.plan_formats[l.module] = ampx::plan::to_string(l.format);
    }
  }
  if (shards_.save) {  // every rank its shard file
    save_sharded_checkpoint(checkpoint_path_, identity_, workload_.steps_per_epoch(), shards_,
                            *setup_.amp, state_, *group_);
  } else if (lead_) {
    save_checkpoint(checkpoint_path_, identity_, workload_.steps_per_epoch(),
                    {*setup_.model, *setup_.optimizer, *setup_.amp}, state_);
  }
  result_.checkpoint_path = checkpoint_path_;
  if (stop) result_.preempted_after = step + 1;
  return stop;
}

EvalResult ModeRun::evaluate() {
  torch::NoGradGuard no_grad;
  setup_.model->eval();
  EvalResult r = workload_.evaluate(
      [&](const torch::Tensor& input) {
        auto forward = setup_.amp->forward_guard();
        return setup_.forward(input);
      },
      device_);
  setup_.model->train();
  return r;
}

RunResult ModeRun::finish() {
  progress_->finish();
  RunResult result = std::move(result_);
  result.losses = std::move(state_.losses);
  if (result.preempted_after > 0) return result;  // the process is asked to end
  // A run resumed with no step left has not entered its tail in step(): the
  // model ends, and is evaluated and exported, as the uninterrupted run's.
  if (tail_start_ < total_steps_) enter_tail(setup_);
  result.peak_bytes = peak_allocated_bytes(device_) - base_bytes_;
  result.optimizer_bytes = optimizer_state_bytes(*setup_.optimizer);
  result.params = setup_.model_params;
  result.weight_bytes = weight_and_grad_bytes(*setup_.model);
  if (setup_.fsdp) {  // between steps the model's parameters are empty; its shards are here
    result.weight_bytes += setup_.fsdp->sharded_bytes();
    result.gathered_bytes = setup_.fsdp->peak_gathered_bytes();
  }
  result.nonfinite_summary = diagnostics_.nonfinite_summary();
  if (config_.range_stats && lead_) {
    const auto path = fs::path(config_.out_dir) / ("range-stats-" + mode_.name + ".json");
    write_output_file(path, diagnostics_.range_stats().to_json() + "\n");
    result.range_stats_path = path.string();
  }
  if (fp8_trace_) result.fp8_trace_path = fp8_trace_->write(config_.out_dir, mode_.name);
  if (setup_.watch && lead_ && setup_.watch->moved()) {
    const auto path = fs::path(config_.out_dir) / "precision-plan-watched.json";
    ampx::plan::save_plan(setup_.watch->plan(), path.string());
    result.watched_plan_path = path.string();
  }
  summarize_timing(workload_, step_ms_, result);
  result.skipped = state_.skipped;
  const auto& losses = result.losses;  // steps >= 1, so never empty
  const auto tail = std::max<std::ptrdiff_t>(1, static_cast<std::ptrdiff_t>(losses.size()) / 10);
  result.train_loss = std::accumulate(losses.end() - tail, losses.end(), 0.0) / tail;
  result.final_scale = setup_.amp->scaler().is_enabled() ? setup_.amp->scaler().get_scale() : 1.0;
  if (evaluates()) result.eval = evaluate();
  if (group_) gather_rank_peaks(*group_, result);
  if (setup_.fsdp) {
    finish_fully_sharded(config_, mode_.name, identity_, *group_, setup_, result);
    return result;
  }
  result.weights_checksum = weights_checksum(*setup_.model);
  if (config_.shard == "optimizer" && !config_.export_weights.empty()) {
    result.weights_path = export_path_for(config_, mode_.name);  // every rank takes part
    export_weights(result.weights_path,
                   dynamic_cast<ampx::dist::ZeroRedundancyOptimizer&>(*setup_.optimizer),
                   *setup_.model, identity_, lead_);
  } else if (lead_ && !config_.export_weights.empty()) {
    result.weights_path = export_path_for(config_, mode_.name);
    export_weights(result.weights_path, *setup_.model,
                   dynamic_cast<const ampx::optim::MixedPrecisionOptimizer&>(*setup_.optimizer),
                   setup_.fp8_layers, identity_);
  }
  return result;
}

}  // namespace

// After llm.c's main loop: a step, its record, the checkpoint rules.
RunResult train_mode(const TrainConfig& config, Workload& workload, const std::string& mode,
                     const ampx::dist::ProcessGroup* group) {
  ModeRun run(config, workload, mode, group);
  for (int64_t step = run.first_step(); step < run.total_steps(); ++step) {
    const StepResult r = run.step(step);
    run.record(step, r);
    if (run.checkpoint(step, r.stop)) break;
  }
  return run.finish();
}

}  // namespace ampx::train
