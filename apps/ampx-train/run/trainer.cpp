#include "trainer.h"

#include "mode_run.h"

#include "checkpoint.h"
#include "device_memory.h"
#include "distributed/rank_agreement.h"
#include "distributed/shard_checkpoint.h"
#include "distributed/sharding.h"
#include "machine.h"
#include "optimizer_options.h"
#include "precision/auto_precision.h"
#include "preemption.h"
#include "progress.h"
#include "reports/fp8_trace.h"
#include "reports/memory_origins.h"
#include "reports/metrics_writer.h"
#include "reports/output_file.h"
#include "reports/profile.h"
#include "reports/report.h"
#include "reports/weights_export.h"

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

}  // namespace

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
  if (config_.memory_origins > 0) {
    result.memory_origins = mode_memory_origins(config_.memory_origins, base_bytes_);
  }
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
