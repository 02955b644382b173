#pragma once

// --precision auto: measure each Linear of the workload's model in each
// format, plan the fastest assignment within --loss-budget on --target
// (ampx/precision_plan.h), print the per-layer table and save the plan;
// --precision-plan FILE loads a saved one instead.
//
//   auto plan = plan_precision(config, *workload);  // measures, prints, writes
//                                                   // <out-dir>/precision-plan.json
//   parse_loss_budget("0.5%");                      // 0.005

#include "cli/config.h"
#include "run/workloads.h"

#include <ampx/precision_plan.h>

#include <string>
#include <vector>

namespace ampx::train {

/// "0.5%" -> 0.005, "0.005" -> 0.005; c10::Error naming --loss-budget and
/// the value when it is not a number > 0.
double parse_loss_budget(const std::string& text);

/// A tail's share of the steps (--plan-tail, --fp8-tail): "10%" -> 0.1,
/// "0.1" -> 0.1, "0" -> 0; c10::Error naming `flag` and the value when it is
/// not a share in [0, 1).
double parse_tail(const std::string& text, const std::string& flag);

/// The floors --plan-ends puts on `model`'s first and last blocks
/// (end_blocks): each at config.plan_ends; none for "none".
std::vector<ampx::plan::Floor> plan_end_floors(const TrainConfig& config,
                                               torch::nn::Module& model);

/// The floors in words: "blocks.0, blocks.3 at 8-bit elements or wider (fp8)"; "none".
std::string floors_text(const std::vector<ampx::plan::Floor>& floors);

/// Where --precision auto's measured plan is written: <out-dir>/precision-plan.json.
std::string measured_plan_path(const TrainConfig& config);

/// The per-layer table: module, share of the Linear FLOPs, each measured
/// format's loss change (and gradient error), the chosen format; then the
/// plan's predicted loss change and modelled cost against bf16 (per step, and
/// over the run with its tail on `model`).
std::string plan_table(const ampx::plan::Measurement& measurement,
                       const ampx::plan::PrecisionPlan& plan, const ampx::plan::CostModel& model);

/// Uniform formats and the fixed rule (`fixed_rule_bf16` in bf16, the rest
/// NVFP4) as the plan's model predicts them: loss change and modelled cost.
std::string alternatives_table(const ampx::plan::Measurement& measurement,
                               const ampx::plan::CostModel& model,
                               const std::vector<std::string>& fixed_rule_bf16);

/// Measures the workload's fresh model (config.seed) over --plan-steps
/// steps of its batches, makes the plan for --loss-budget and --target,
/// prints the table and writes the plan to measured_plan_path(). Returns
/// that path. The checkpoint rules are checked first (check_checkpoint_rules
/// for the auto mode's checkpoint): a fresh run they refuse measures nothing
/// and leaves the plan file a checkpointed run trained with as it was.
std::string plan_precision(const TrainConfig& config, Workload& workload);

/// The text of the plan file at `path` (what checkpoints keep, and what rank
/// 0 hands the other ranks); c10::Error naming it when it cannot be read.
std::string read_plan_text(const std::string& path);

/// --resume with --precision auto and no --precision-plan: the plan the
/// auto mode's checkpoint trained with (it keeps the plan file's text),
/// written next to it as `precision-plan.json` for the run to apply again.
/// Returns that path; c10::Error naming the checkpoint when it has none.
std::string resumed_plan(const TrainConfig& config);

}  // namespace ampx::train
