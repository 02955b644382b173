#pragma once

/// \file
/// The measurement a precision plan is solved from (ampx/precision_plan.h):
/// each Linear's loss change and gradient error in each format, the proof
/// run of a plan, and the targets' cost models.

#include "ampx/plan/formats.h"

#include <ATen/core/Tensor.h>
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
  double reference_loss = 0;                       ///< the reference's evaluation loss
  int64_t steps = 0;                               ///< training steps of each probe
  int64_t eval_batches = 0;                        ///< evaluation batches of each probe
  uint64_t seed = 0;                               ///< the seed of the probes
  int64_t probes = 0;                              ///< probes run, the reference included
  double seconds = 0;                              ///< wall time of the measurement
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

}  // namespace plan
}  // namespace ampx
