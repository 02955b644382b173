#pragma once

/// \file
/// Automatic per-layer precision: measure how sensitive each Linear of a
/// model is to each low-precision format, choose the fastest assignment of
/// formats whose predicted loss change stays within a budget, save it, and
/// apply it to a model (issue 44).
///
/// ```
///   ampx::plan::MeasureProblem problem;
///   problem.make_model = [&] { return std::make_shared<Net>(); };   // same architecture
///   problem.loss = [&](torch::nn::Module& m, int64_t step) {       // batch `step`'s loss
///     return loss_fn(static_cast<Net&>(m).forward(x[step]), y[step]);
///   };
///   auto measured = ampx::plan::measure_layers(*model, problem,
///                                              ampx::plan::MeasureOptions().steps(4));
///   auto plan = ampx::plan::make_plan(measured,
///                                     ampx::plan::PlanOptions(0.005)   // 0.5% of the loss
///                                         .cost_model(ampx::plan::cost_model_for("b200")));
///   plan.layers[0].format;                     // e.g. LayerFormat::kNvfp4
///   ampx::plan::save_plan(plan, "plan.json");
///   ampx::plan::apply_plan(*model, ampx::plan::load_plan("plan.json"));
///   {
///     ampx::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);  // bf16 layers
///     ampx::fp8::Fp8AutocastGuard fp8;                               // FP8/FP4 layers
///     loss_fn(model->forward(x0), y0).backward();
///   }
/// ```
///
/// The measurement runs one probe per (Linear, format) and one reference,
/// every Linear in the reference format (MeasureOptions::reference: bf16,
/// or fp32 for a budget against float32 training); the rest of the model
/// runs under bf16 autocast, as ampx-train's modes run it. Each probe starts
/// from the model's weights, puts only its layer in its format (the others
/// in the reference's), trains `steps` steps of AdamW on the batches
/// 0..steps-1, and evaluates the loss on the batches steps..steps+eval_batches-1.
/// The loss change of a probe is its evaluation loss relative to the
/// reference's; its gradient error is the relative L2 distance of its
/// layer's first weight gradient from the reference's (same weights, same
/// batch: the format's own error). The plan's model of a whole assignment
/// is additive: its loss change is the sum of its layers' (negative
/// changes counted as zero), an assumption the proof run checks.

/// \namespace ampx::plan
/// Automatic per-layer precision: the measurement, the plan, its file, its
/// application and its proof (docs/numerics.md).

#include "ampx/dist.h"
#include "ampx/fp8/scaling.h"

#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
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

/// A Linear layer's format in a plan. Named as ampx-train's modes name them.
enum class LayerFormat {
  /// "fp32": float32 operands and products, outside autocast (a wide product)
  kFloat32,
  /// "fp16": float16 operands and products (float32 accumulation), the output
  /// unscaled in float32 and the bias added there; the weight scaled by a
  /// power of two to a largest value in (0.5, 1], and before each product
  /// the other operand (the input forward, the output gradient backward) by
  /// the largest power of two that keeps it and the product's worst case
  /// within 2^15: float16's loss scaling done per layer, product and step
  /// (no step skipped), for the activations too
  kFloat16,
  kBFloat16,  ///< "bf16": the layer runs under bf16 autocast (not converted)
  kFp8,       ///< "fp8": FP8 tensorwise current scaling (HYBRID: E4M3 forward, E5M2 gradients)
  kMxfp8,     ///< "mxfp8": MXFP8BlockScaling (E4M3, E8M0 per 1 x 32)
  kNvfp4,     ///< "nvfp4": NVFP4BlockScaling (E2M1, E4M3 per 16, fp32 per tensor)
  kFp8Block,  ///< "fp8-block": Float8BlockScaling (1 x 128, 128 x 128 weights)
};

/// "fp32", "fp16", "bf16", "fp8", "mxfp8", "nvfp4", "fp8-block".
std::string to_string(LayerFormat format);
/// The format named `name` (as to_string writes it); c10::Error naming
/// `what` and the value otherwise.
LayerFormat parse_layer_format(const std::string& name, const std::string& what = "format");
/// Every format, widest first: fp32, fp16, bf16, fp8-block, fp8, mxfp8, nvfp4.
std::vector<LayerFormat> all_layer_formats();
/// The fp8::Recipe a converted layer of `format` runs (NVFP4's stochastic
/// rounding drawn from `seed`); c10::Error for bf16 (autocast runs it) and
/// fp32 and fp16 (wide products).
fp8::Recipe recipe_of(LayerFormat format, uint64_t seed = 0);
/// The scale rule a layer of `format` is cast with, as its recipe names it
/// ("current(hybrid)", "nvfp4(16x16 weights, ...)"); bf16: "autocast (no scale)";
/// fp32 and fp16 say how their products run.
std::string scale_rule_of(LayerFormat format, uint64_t seed = 0);

struct PrecisionPlan;

/// The user's model and data, as the measurement sees them.
struct MeasureProblem {
  /// A new model of the same architecture as the one measured (its weights
  /// are overwritten with the measured model's): one per probe.
  std::function<std::shared_ptr<torch::nn::Module>()> make_model;
  /// The loss of batch `step` (0, 1, ...) through `model`: its forward and
  /// the loss, a float32 scalar. Must give the same batch for the same step.
  std::function<at::Tensor(torch::nn::Module& model, int64_t step)> loss;
};

/// How the measurement probes the model.
struct MeasureOptions {
  /// Training steps of each probe (batches 0..steps-1), >= 1.
  TORCH_ARG(int64_t, steps) = 4;
  /// Batches each probe's loss is evaluated on after its steps, >= 1.
  TORCH_ARG(int64_t, eval_batches) = 2;
  /// The formats measured for each layer (the reference's is always in a plan).
  TORCH_ARG(std::vector<LayerFormat>, formats) = all_layer_formats();
  /// The format of every Linear in the reference run the loss changes are
  /// relative to: bf16 (a budget against ampx-train's O2) or fp32 (against
  /// float32 training, where bf16 itself costs budget).
  TORCH_ARG(LayerFormat, reference) = LayerFormat::kBFloat16;
  /// The probes' AdamW learning rate (> 0).
  TORCH_ARG(double, lr) = 1e-3;
  /// Seeds torch before each probe and NVFP4's stochastic rounding.
  TORCH_ARG(uint64_t, seed) = 0;
  /// Rows each Linear sees per step (tokens, or samples): for the FLOPs.
  TORCH_ARG(int64_t, tokens_per_step) = 1;
  /// Steps in one epoch of the user's training, to state the cost as a fraction (0: unknown).
  TORCH_ARG(int64_t, steps_per_epoch) = 0;
};

/// What one probe of one layer in one format measured.
struct FormatMeasurement {
  LayerFormat format = LayerFormat::kBFloat16;  ///< the probed format
  double loss_change = 0;  ///< (probe loss - reference loss) / reference loss, signed
  double grad_error = 0;   ///< ||g - g_ref|| / ||g_ref|| of the layer's first weight gradient
};

/// Everything measured of one Linear.
struct LayerMeasurement {
  std::string module;                      ///< its path in the model, e.g. "blocks.0.fc"
  int64_t in_features = 0;                 ///< its weight's columns
  int64_t out_features = 0;                ///< its weight's rows
  double flops = 0;                        ///< 3 products of 2 * in * out * tokens_per_step each
  double flops_share = 0;                  ///< flops / the sum over the model's Linears
  double weight_amax = 0;                  ///< the largest |w| of its weight at the start
  std::vector<FormatMeasurement> formats;  ///< one per measured format it takes
};

/// The result of measure_layers().
struct Measurement {
  LayerFormat reference = LayerFormat::kBFloat16;  ///< every Linear's format in the reference
  double reference_loss = 0;  ///< the reference's evaluation loss
  int64_t steps = 0;          ///< training steps of each probe
  int64_t eval_batches = 0;   ///< evaluation batches of each probe
  uint64_t seed = 0;          ///< the seed of the probes
  int64_t probes = 0;         ///< probes run, the reference included
  double seconds = 0;         ///< wall time of the measurement
  double epoch_fraction = 0;  ///< probes * (steps + eval) / steps_per_epoch; 0 if unknown
  std::vector<LayerMeasurement> layers;  ///< the model's Linears, in module order
};

/// Measures every Linear of `model` (left unchanged) in each format of
/// `options` (see the top of this header). Linears whose dimensions are not
/// multiples of 16 take no FP8 or FP4 format: fp32, fp16 and bf16 only.
/// Deterministic for a seed.
Measurement measure_layers(torch::nn::Module& model, const MeasureProblem& problem,
                           const MeasureOptions& options = MeasureOptions());

/// The proof of a plan: training with it against the reference.
struct PlanCheck {
  double loss = 0;            ///< evaluation loss of the run with the plan applied
  double reference_loss = 0;  ///< the reference's (every Linear in the reference format)
  double loss_change = 0;     ///< (loss - reference_loss) / reference_loss
};

/// Trains a copy of `model` with `plan` applied (apply_plan, seeded with
/// options.seed) as each probe of measure_layers() trains (same steps,
/// batches, seed and learning rate), and the reference beside it: the
/// loss change the plan's additive model predicted, measured. c10::Error
/// when options.reference() is not the plan's reference.
PlanCheck check_plan(torch::nn::Module& model, const MeasureProblem& problem,
                     const PrecisionPlan& plan, const MeasureOptions& options = MeasureOptions());

/// Relative product throughput per format on a target (bf16 = 1); a format
/// the target cannot run is absent.
struct CostModel {
  std::string target;                        ///< "h100", "b200", "cpu", or the user's
  std::map<LayerFormat, double> throughput;  ///< products per second, relative to bf16
  std::string source;                        ///< where the numbers come from
};

/// The cost model of "h100" or "b200" (published dense peak ratios, see
/// docs/numerics.md), or "cpu" (measure_cpu_cost_model()); c10::Error
/// naming the target otherwise.
CostModel cost_model_for(const std::string& target);
/// Times one emulated product (forward and backward of a 256 x 256 Linear on
/// 256 rows) per format on this machine's CPU: throughput relative to bf16.
CostModel measure_cpu_cost_model();

/// The bits of one element of `format`: 32 (fp32), 16 (fp16, bf16), 8
/// (fp8, fp8-block, mxfp8), 4 (nvfp4). What a Floor compares.
int element_bits(LayerFormat format);

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
  std::string target;                ///< the cost model's target
  LayerFormat reference = LayerFormat::kBFloat16;  ///< the measurement's reference format
  double loss_budget = 0;            ///< the budget it was solved for
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
  std::vector<LayerPlan> layers;     ///< in module order
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

/// The solver's core, public for tests: picks one option per group,
/// minimising the summed cost with the summed (non-negative) weights <=
/// capacity; returns the chosen index per group. weights[g][i] and
/// costs[g][i] describe option i of group g. c10::Error when nothing fits.
std::vector<size_t> solve_multiple_choice(const std::vector<std::vector<double>>& weights,
                                          const std::vector<std::vector<double>>& costs,
                                          double capacity, int64_t steps);

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

/// What the watch found wrong with a planned layer.
enum class WatchFinding {
  /// Its weight gradient's norm fell below noise_ratio times the norm of its
  /// format's error against the bf16 gradient of the same weights and batch:
  /// the format's noise drowns the gradient ("FP4 all the way": training in a
  /// format stops helping below sqrt(3)).
  kGradientBelowNoise,
  /// More than underflow_fraction of the bf16 gradient's non-zero values are
  /// zero in the format's gradient: its range flushes them.
  kUnderflow,
  /// The format's gradient has an inf or NaN where the bf16 one is finite.
  kOverflow,
};

/// "gradient below noise", "underflow", "overflow".
std::string to_string(WatchFinding finding);

/// One finding of the watch: a layer, the step, the numbers.
struct WatchEvent {
  int64_t step = 0;                                          ///< the step checked
  std::string module;                                        ///< the layer's path
  LayerFormat format = LayerFormat::kBFloat16;               ///< its format when checked
  WatchFinding finding = WatchFinding::kGradientBelowNoise;  ///< what was wrong
  double gradient_norm = 0;  ///< ||g_bf16||, the bf16 weight gradient's norm
  double noise_norm = 0;     ///< ||g_format - g_bf16||
  double underflow = 0;      ///< share of g_bf16's non-zero values that are 0 in g_format
  double non_finite = 0;     ///< share of g_format's values that are inf or NaN
  /// The layer's format after the check: one wider than `format` when the
  /// watch moved it (WatchOptions::widen), else `format`.
  LayerFormat moved_to = LayerFormat::kBFloat16;
  /// One line: "step 40: fc2 (nvfp4) gradient below noise: |g| 1.2e-05 <
  /// 1.73 x noise 3.1e-05; moved to mxfp8".
  std::string message() const;
};

/// How PlanWatch checks a plan while training runs.
struct WatchOptions {
  /// Checks every `every` steps (steps 0, every, 2 every, ...), >= 1.
  TORCH_ARG(int64_t, every) = 50;
  /// A layer whose gradient norm is below noise_ratio x its format's noise
  /// norm is reported (> 0; sqrt(3), after "FP4 all the way").
  TORCH_ARG(double, noise_ratio) = 1.7320508075688772;
  /// A layer whose format zeroes more than this share of its bf16
  /// gradient's non-zero values is reported (in [0, 1)).
  TORCH_ARG(double, underflow_fraction) = 0.01;
  /// Moves a reported layer to the next wider format its plan's target runs
  /// (nvfp4 -> mxfp8 -> fp8 -> fp8-block -> bf16; fp16 -> fp32). The moved layer's
  /// scaling starts afresh (the plans' formats keep no state between steps);
  /// the buffers its first format registered stay in the module's state.
  TORCH_ARG(bool, widen) = false;
  /// Data-parallel training: the ranks' group. Every rank then takes rank
  /// 0's numbers, findings and moves (one broadcast of six numbers per
  /// watched layer), so that every rank reports and moves the same layers
  /// at the same step even where its own numbers differ in their last bits
  /// (or its thresholds differ). Every rank must call check() at the same
  /// steps with the same plan: the broadcast pairs up by order. The
  /// backward given to check() must average the gradients as the step's
  /// did (DistributedDataParallel::synchronize() after it).
  TORCH_ARG(c10::optional<dist::ProcessGroup>, group) = c10::nullopt;
};

/// Checks a plan applied to a model (apply_plan) as training runs. At a
/// step due(), after the step's backward and before the optimizer's step,
/// check() keeps every planned layer's weight gradient, runs the caller's
/// backward of the same batch again with FP8 off (every Linear in bf16, as
/// the measurement's default reference, whatever the plan's), compares each
/// layer's two gradients, and puts back every parameter's gradient, the
/// model's buffers and the CPU generator's state: the training goes on
/// exactly as without the check.
///
/// ```
///   ampx::plan::PlanWatch watch(*model, plan, ampx::plan::WatchOptions().every(50).widen(true));
///   watch.begin_step(s);   // only if the forward draws random numbers (dropout)
///   ...  // step s: forward in the plan's formats, backward
///   if (watch.due(s)) {
///     for (const auto& e : watch.check(s, [&] { loss_of(batch).backward(); }))
///       std::cerr << e.message() << "\n";
///   }
///   optimizer.step();
/// ```
///
/// `backward` must run the forward without opening an FP8 region of its own
/// (the watch runs it in one with FP8 off) and must not step; with a loss
/// scaler, scale the loss as the step did. A check costs one forward and
/// backward. In data-parallel training the watch compares the averaged
/// gradients: check() after DistributedDataParallel::synchronize(), a
/// `backward` that synchronizes too, and WatchOptions::group.
class PlanWatch {
 public:
  /// Watches the layers `plan` gives a format other than bf16 and fp32 (as
  /// wide as the bf16 gradient compared with, or wider) in `model`, which
  /// must have the plan applied (c10::Error naming a planned module that is
  /// not a converted Linear of `model`).
  PlanWatch(torch::nn::Module& model, PrecisionPlan plan,
            const WatchOptions& options = WatchOptions());

  /// Whether step `step` is checked.
  bool due(int64_t step) const;

  /// For a model that draws random numbers in its forward (dropout): call
  /// before step `step`'s forward; at a due step it keeps the generators'
  /// state (the CPU's, and the CUDA device's the model is on), from which
  /// check() runs the reference, so it draws the same masks as the step.
  void begin_step(int64_t step);

  /// Checks every watched layer at `step` (see above); returns its events,
  /// also added to events(). c10::Error if a watched layer has no weight
  /// gradient before or after `backward`.
  std::vector<WatchEvent> check(int64_t step, const std::function<void()>& backward);

  /// The plan as it stands: the moved layers in their new formats.
  const PrecisionPlan& plan() const { return plan_; }

  /// Every event so far, in step order.
  const std::vector<WatchEvent>& events() const { return events_; }

  /// Whether a layer's format is no longer the one the plan gave it (moved
  /// by check() with widen, or by restore()).
  bool moved() const;

  /// Puts the watched layers in `formats` (module -> format: the plan() of
  /// an earlier watch of the same plan and model, as a checkpoint keeps it),
  /// each layer whose format differs moved to it as widen moves one, so that
  /// a resumed run trains as the one it continues; plan() then holds them.
  /// c10::Error naming a module the plan lacks, or a format the watch could
  /// not have moved the layer to (it only widens, along wider_format).
  void restore(const std::map<std::string, LayerFormat>& formats);

 private:
  // Moves `layer` (`linear` of the model) to `to`, as widen does.
  void move(LayerPlan& layer, torch::nn::LinearImpl& linear, LayerFormat to);

  torch::nn::Module* model_;
  PrecisionPlan plan_;
  WatchOptions options_;
  std::vector<WatchEvent> events_;
  std::vector<LayerFormat> planned_;     // each layer's format in the plan given
  int64_t begun_ = -1;                   // the step begin_step() kept the state of
  std::vector<at::Tensor> begun_state_;  // the generators' states then
};

/// The next format wider than `format` that `target`'s cost model runs
/// (h100 and b200: those cost_model_for names; any other target: every
/// format), along nvfp4 -> mxfp8 -> fp8 -> fp8-block -> bf16; fp16 moves to
/// fp32 (the range it lacks); bf16 and fp32 stay.
LayerFormat wider_format(LayerFormat format, const std::string& target);

}  // namespace plan
}  // namespace ampx
