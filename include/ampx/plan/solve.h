#pragma once

/// \file
/// The plan (ampx/precision_plan.h): solved from a measurement within a loss
/// budget, proven, saved and loaded, applied to a model, and its tail.

#include "ampx/plan/measure.h"

#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch {
namespace nn {
class LinearImpl;
class Module;
}  // namespace nn
}  // namespace torch

namespace ampx {
namespace plan {

/// The narrowest format the Linears at or under `prefix` may take: a layer
/// whose path is `prefix` or starts with `prefix` + "." ("blocks.0" holds
/// "blocks.0.attn.qkv") takes only formats whose elements are at least as
/// wide as `format`'s (element_bits): {"blocks.0", kFp8} keeps that block in
/// 8 bits or more, out of NVFP4, and leaves the plan its choice among the
/// 8-bit formats and the wider ones. The published NVFP4 recipe keeps the
/// first and last blocks wide by position; the probes' few steps do not see
/// why (docs/numerics.md).
struct Floor {
  std::string prefix;                           ///< a Linear's path, or a module above some
  LayerFormat format = LayerFormat::kBFloat16;  ///< the narrowest allowed
};

/// What make_plan() solves for.
struct PlanOptions {
  /// Plans within `loss_budget`, a relative loss change (0.005: 0.5%).
  explicit PlanOptions(double loss_budget) : loss_budget_(loss_budget) {}
  /// The largest predicted relative loss change allowed (> 0).
  TORCH_ARG(double, loss_budget);
  /// The target's throughput per format.
  TORCH_ARG(CostModel, cost_model) = cost_model_for("b200");
  /// Steps the loss budget is cut into for the exact solver (>= 1).
  TORCH_ARG(int64_t, budget_steps) = 2000;
  /// Seed of NVFP4's stochastic rounding in the plan's scale rules.
  TORCH_ARG(uint64_t, seed) = 0;
  /// The plan's tail (PrecisionPlan::tail), in [0, 1): the share of a run's
  /// last steps in which every Linear trains in the reference's format.
  TORCH_ARG(double, tail) = 0;
  /// Floors the plan keeps (PrecisionPlan::floors): a layer under two takes
  /// the wider. A prefix naming no measured Linear, or a floor that leaves a
  /// layer no format the target runs, is a c10::Error naming it.
  TORCH_ARG(std::vector<Floor>, floors) = {};
};

/// One layer of a plan.
struct LayerPlan {
  std::string module;                           ///< its path in the model
  LayerFormat format = LayerFormat::kBFloat16;  ///< the chosen format
  std::string scale_rule;                       ///< scale_rule_of(format)
  double loss_change = 0;                       ///< measured, for the chosen format
  double grad_error = 0;                        ///< measured, for the chosen format
  double flops_share = 0;                       ///< the layer's share of the Linear FLOPs
  std::string reason;                           ///< why this format, in words
};

/// A plan: one format per Linear, the fastest whose predicted loss change fits.
struct PrecisionPlan {
  std::string target;                              ///< the cost model's target
  LayerFormat reference = LayerFormat::kBFloat16;  ///< the measurement's reference format
  double loss_budget = 0;                          ///< the budget it was solved for
  double predicted_loss_change = 0;  ///< sum of the chosen formats' loss changes (>= 0 each)
  double cost = 0;                   ///< modelled product time: sum of flops_share / throughput
  double bf16_cost = 1;              ///< the same for every layer in bf16 (1)
  /// The share of a run's steps, at its end, in which every Linear trains in
  /// `reference`, in [0, 1) (0: none): the late switch of NVIDIA's NVFP4
  /// pretraining recipe and torchtitan's (tail_start(), enter_tail()). Not
  /// in `cost` (one step's) nor in the predicted loss change; run_cost().
  double tail = 0;
  /// The floors it was solved under (PlanOptions::floors), in their order;
  /// every layer under one holds a format at least as wide (save_plan and
  /// load_plan refuse another). The tail is the reference's: there every
  /// planned Linear trains in `reference`, a layer floored wider too.
  std::vector<Floor> floors;
  std::vector<LayerPlan> layers;  ///< in module order
};

/// The fastest plan (least modelled cost) whose predicted loss change is
/// within the budget: a multiple-choice knapsack solved exactly by dynamic
/// programming over the budget cut into budget_steps (each loss change
/// rounded up, so the plan's true sum is within the budget), among the
/// formats options.floors() leave each layer. Ties go to the smaller loss
/// change, then the wider format.
PrecisionPlan make_plan(const Measurement& measurement, const PlanOptions& options);

/// A plan whose proof run held it within its budget.
struct ProvenPlan {
  PrecisionPlan plan;         ///< the plan kept; its loss_budget is the one asked for
  PlanCheck check;            ///< its proof run (check_plan)
  double planned_budget = 0;  ///< the budget the kept plan was solved for (0: all bf16)
  int64_t rounds = 0;         ///< plans proven, the kept one included
};

/// make_plan(), then its proof run (check_plan). The additive model misses
/// the layers' interactions, so a plan predicted within the budget may train
/// outside it: while the proof run's loss change exceeds
/// options.loss_budget(), solves again for 0.9 x the smaller of the last
/// planned budget and the last prediction, times budget / measured change,
/// and proves that, at most `max_rounds` plans (>= 1; a smaller budget that
/// the floors' layers alone exceed ends the rounds early); if none held, the
/// plan with every Linear in the reference's format (the reference itself,
/// a change of 0; a layer whose floor is wider than the reference in the
/// fastest format its floor allows). c10::Error when
/// measure_options.reference() is not the measurement's.
ProvenPlan prove_plan(torch::nn::Module& model, const MeasureProblem& problem,
                      const Measurement& measurement, const PlanOptions& options,
                      const MeasureOptions& measure_options = MeasureOptions(),
                      int64_t max_rounds = 4);

/// Writes `plan` to `path` as JSON with a fixed key order (diffable),
/// atomically.
void save_plan(const PrecisionPlan& plan, const std::string& path);
/// Reads a plan save_plan() wrote; c10::Error naming the file, the key and
/// the value on anything else (unreadable file, corrupt JSON, unknown format).
PrecisionPlan load_plan(const std::string& path);
/// The plan in `text`, the content of a file save_plan() wrote (read once,
/// e.g. to keep beside what it applies); c10::Error as load_plan's, naming
/// `source` where it names the file.
PrecisionPlan parse_plan(const std::string& text, const std::string& source = "plan");

/// Converts each Linear of `model` the plan gives an FP8 or FP4 format to it
/// (fp8::convert_linears with the format's recipe, NVFP4 seeded with
/// `seed`), and gives its fp32 and fp16 layers their wide products (inside
/// an Fp8AutocastGuard region, as the FP8 layers); bf16 layers and Linears
/// the plan does not name stay as they are, for bf16 autocast. A plan module
/// that is not a Linear of `model` is a c10::Error naming it. Returns the
/// converted paths.
std::vector<std::string> apply_plan(torch::nn::Module& model, const PrecisionPlan& plan,
                                    uint64_t seed = 0);

/// The first step of `plan`'s tail in a run of steps 0..total_steps-1:
/// total_steps - round(plan.tail x total_steps) (total_steps: no tail).
/// c10::Error for a tail outside [0, 1) or total_steps < 0.
int64_t tail_start(const PrecisionPlan& plan, int64_t total_steps);

/// Enters `plan`'s tail: every Linear the plan names in `model` (applied by
/// apply_plan, perhaps moved by a PlanWatch since) trains in plan.reference
/// from now on: a bf16 reference turns them back into plain Linears (bf16
/// autocast, as if never converted), an fp32 one gives them float32
/// products. Call before the step tail_start() returns; a PlanWatch has
/// nothing left to check after it (stop calling check()). The buffers of
/// their first formats stay, so checkpoints keep loading.
void enter_tail(torch::nn::Module& model, const PrecisionPlan& plan);

/// The plan's modelled product time averaged over a run, relative to
/// bf16_cost's units: (1 - tail) x cost + tail x the cost of every Linear in
/// plan.reference on `model` (bf16_cost for a bf16 reference). c10::Error
/// when `model` lacks the reference's format.
double run_cost(const PrecisionPlan& plan, const CostModel& model);

}  // namespace plan
}  // namespace ampx
