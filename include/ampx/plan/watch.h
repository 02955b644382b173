#pragma once

/// \file
/// The plan watch (ampx/precision_plan.h): checks a plan applied to a model
/// as training runs, and widens the layers whose format fails.

#include "ampx/plan/solve.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace torch {
namespace nn {
class LinearImpl;
class Module;
}  // namespace nn
}  // namespace torch

namespace ampx {
namespace dist {
class ProcessGroup;
}  // namespace dist

namespace plan {

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
  /// A process group the caller owns (the watch only points to it).
  using GroupPtr = const dist::ProcessGroup*;
  /// Data-parallel training: the ranks' group, which must outlive the watch
  /// (null: one process). Every rank then takes rank 0's numbers, findings
  /// and moves (one broadcast of six numbers per watched layer), so that
  /// every rank reports and moves the same layers at the same step even
  /// where its own numbers differ in their last bits (or its thresholds
  /// differ). Every rank must call check() at the same steps with the same
  /// plan: the broadcast pairs up by order. The backward given to check()
  /// must average the gradients as the step's did
  /// (DistributedDataParallel::synchronize() after it).
  TORCH_ARG(GroupPtr, group) = nullptr;
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

}  // namespace plan
}  // namespace ampx
