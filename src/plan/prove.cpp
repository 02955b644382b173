// A plan proven on training: make_plan, check_plan, and again for a smaller
// budget while the proof run leaves the one asked for.

#include "ampx/precision_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace ampx {
namespace plan {

ProvenPlan prove_plan(torch::nn::Module& model, const MeasureProblem& problem,
                      const Measurement& measurement, const PlanOptions& options,
                      const MeasureOptions& measure_options, int64_t max_rounds) {
  TORCH_CHECK_VALUE(max_rounds >= 1, "ampx::plan::prove_plan: max_rounds must be >= 1, got ",
                    max_rounds);
  const double budget = options.loss_budget();
  PlanOptions round = options;
  ProvenPlan proven;
  for (proven.rounds = 1; proven.rounds <= max_rounds; ++proven.rounds) {
    proven.plan = make_plan(measurement, round);
    proven.planned_budget = round.loss_budget();
    proven.check = check_plan(model, problem, proven.plan, measure_options);
    if (proven.check.loss_change <= budget) break;
    // Smaller than both the budget and the prediction that missed, in the
    // proportion the proof run missed by.
    const double missed = budget / proven.check.loss_change;
    round.loss_budget(0.9 * std::min(round.loss_budget(), proven.plan.predicted_loss_change) *
                      missed);
    if (!(round.loss_budget() > 0)) break;  // a prediction of 0: nothing narrower to drop
  }
  if (proven.check.loss_change > budget) {
    // Every Linear in bf16: the reference itself.
    Measurement bf16_only = measurement;
    for (auto& layer : bf16_only.layers) {
      layer.formats.erase(std::remove_if(layer.formats.begin(), layer.formats.end(),
                                         [](const FormatMeasurement& f) {
                                           return f.format != LayerFormat::kBFloat16;
                                         }),
                          layer.formats.end());
    }
    round.loss_budget(budget);
    proven.plan = make_plan(bf16_only, round);
    proven.planned_budget = 0;
    proven.check = check_plan(model, problem, proven.plan, measure_options);
    proven.rounds = std::min(proven.rounds, max_rounds) + 1;
  }
  proven.plan.loss_budget = budget;
  return proven;
}

}  // namespace plan
}  // namespace ampx
