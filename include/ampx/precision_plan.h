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
///
/// The parts: ampx/plan/formats.h (the formats), ampx/plan/measure.h (the
/// measurement, the proof run, the cost models), ampx/plan/solve.h (the plan:
/// solved, proven, saved, applied, its tail), ampx/plan/watch.h (PlanWatch).

/// \namespace ampx::plan
/// Automatic per-layer precision: the measurement, the plan, its file, its
/// application and its proof (docs/numerics.md).

#include "ampx/plan/formats.h"
#include "ampx/plan/measure.h"
#include "ampx/plan/solve.h"
#include "ampx/plan/watch.h"
