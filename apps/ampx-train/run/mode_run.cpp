// ModeRun's set-up (mode_run.h): from the flags to the first step.

#include "mode_run.h"

#include "device_memory.h"
#include "distributed/rank_agreement.h"
#include "distributed/sharding.h"
#include "machine.h"
#include "precision/auto_precision.h"
#include "reports/memory_origins.h"
#include "reports/profile.h"

#include <ampx/ampx.h>

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>

namespace ampx::train {

namespace fs = std::filesystem;

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

  describe_identity();

  checkpoint_path_ = checkpoint_path_for(config, mode_.name);
  from_rank0(group, [&] {  // rank 0 alone writes and reads checkpoints
    check_checkpoint_rules(config, checkpoint_path_);
    return std::string();
  });
  // A preemption checkpoint never replaces one this run neither resumed nor writes anyway.
  may_write_checkpoint_ = config.resume || config.save_every > 0 || !fs::exists(checkpoint_path_);

  base_bytes_ = allocated_bytes(device_);
  if (config.memory_origins > 0) ampx::start_cpu_memory_origins();
  reset_peak_memory(device_);
  ampx::CpuMemoryPhaseGuard phase(kSetUpPhase);
  setup_ = set_up_mode(config, workload, mode_, device_, group);
  shards_ = shard_io(config, setup_);
  place_tail();
  join_ranks();
  resume();
  open_outputs();
  start_ = std::chrono::steady_clock::now();
}

void ModeRun::describe_identity() {
  identity_ = workload_.identity();
  identity_["precision"] = mode_.name;
  identity_["dtype"] = result_.dtype;
  identity_["device"] = config_.device;
  identity_["steps_per_epoch"] = workload_.steps_per_epoch();
  if (mode_.name == "auto") {
    identity_["fp8_recipe"] = "plan";
  } else if (mode_.fp8) {
    identity_["fp8_recipe"] = fp8_recipe_of(config_, mode_.name).to_string();
  }
}

void ModeRun::place_tail() {
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
    fixed.tail = parse_tail(config_.fp8_tail, "--fp8-tail");
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
      std::cout << "--fp8-tail " << config_.fp8_tail;
    }
    std::cout << " of " << total_steps_ << " steps rounds to no step: it trains without one"
              << std::endl;
  }
  TORCH_CHECK(tail_start_ > 0 || tail_start_ == total_steps_, "ampx-train: ",
              setup_.plan ? "the plan's tail (" + std::to_string(setup_.plan->tail) + ")"
                          : "--fp8-tail " + config_.fp8_tail,
              " covers every one of the run's ", total_steps_,
              " steps, which would then all train with every Linear in ", result_.dtype,
              "; give a smaller share or more --steps");
  result_.tail_start = tail_start_ < total_steps_ ? tail_start_ : -1;
}

void ModeRun::join_ranks() {
  // Before DDP's broadcast of the parameters: a rank started with another
  // model shape or precision fails here, on every rank, naming the difference.
  if (group_) {
    nlohmann::json identity = identity_;
    if (setup_.plan) {  // and the plan's watch: its steps and settings
      identity["plan_watch"] = config_.plan_watch;
      identity["plan_widen"] = config_.plan_widen;
      identity["plan_noise_ratio"] = config_.plan_noise_ratio;
    }
    check_ranks_agree(*group_, run_fingerprint(identity, *setup_.model, total_steps_));
  }
  // After the cast: the broadcast and the buckets see the training dtypes.
  // (--shard: the wrapper or ZeRO-1 reduces the gradients instead.)
  if (group_ && config_.shard == "none") ddp_.emplace(setup_.model, *group_);
  // TE's reduce_amax: the same scales on every rank, so the ranks stay bitwise.
  const bool tensorwise =
      setup_.fp8 && mode_.name != "auto" && !fp8_recipe_of(config_, mode_.name).is_block();
  if (group_ && tensorwise && fp8_recipe_of(config_, mode_.name).is_delayed()) {
    setup_.fp8_group = group_;
  }
  if (tensorwise && lead_) {
    fp8_trace_.emplace(config_.fp8_trace_layer, *setup_.model, setup_.fp8_layers);
  }
}

void ModeRun::resume() {
  if (config_.resume) {
    const std::string bytes =
        from_rank0(group_, [&] { return read_checkpoint_bytes(checkpoint_path_); });
    state_ = shards_.load ? load_sharded_checkpoint(checkpoint_path_, bytes, identity_, shards_,
                                                    *setup_.amp, *group_)
                          : load_checkpoint(checkpoint_path_, bytes, identity_,
                                            {*setup_.model, *setup_.optimizer, *setup_.amp});
    TORCH_CHECK(state_.next_step <= total_steps_, "ampx-train: checkpoint '", checkpoint_path_,
                "' is at step ", state_.next_step, ", past this run's ", total_steps_,
                " steps; raise --steps");
    if (!state_.plan_formats.empty()) {  // the layers the watch had moved, moved again
      TORCH_CHECK(setup_.watch && config_.plan_widen, "ampx-train: checkpoint '", checkpoint_path_,
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
}

void ModeRun::open_outputs() {
  if (lead_) {
    fs::create_directories(config_.out_dir);
    const bool csv = config_.metrics_format == "csv";
    metrics_.emplace(
        fs::path(config_.out_dir) / ("metrics-" + mode_.name + (csv ? ".csv" : ".jsonl")), csv,
        config_.resume ? state_.next_step - 1 : -1);
    result_.metrics_path = metrics_->path().string();
  }
  progress_.emplace(mode_.name, state_.next_step, total_steps_, workload_.unit() + "/s",
                    lead_ ? Progress::style_for(config_.progress) : Progress::Style::kNone,
                    config_.log_every);
  // --profile: one step after warm-up, left out of the timing (the profiler slows it).
  if (!config_.profile.empty() && lead_) {
    profile_step_ = state_.next_step + std::min<int64_t>(10, (total_steps_ - state_.next_step) / 2);
    profile_path_ = profile_path_for(config_.profile, mode_.name, !config_.compare.empty());
  }
}

}  // namespace ampx::train
