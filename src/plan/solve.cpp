// The plan: one format per layer, the least modelled cost within the loss
// budget, by an exact dynamic program over the budget cut into steps.

#include "ampx/precision_plan.h"

#include "ampx/detail/plan_solver.h"

#include "linears.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>

namespace ampx {
namespace plan {
namespace {

// A partial solution's value: lexicographic (cost, budget steps used).
struct DpValue {
  double cost = std::numeric_limits<double>::infinity();
  int64_t used = 0;
  bool better_than(const DpValue& o) const {
    return cost < o.cost || (cost == o.cost && used < o.used);
  }
};

std::string percent(double v) {
  std::ostringstream s;
  s << std::showpos << std::setprecision(3) << 100.0 * v << "%";
  return s.str();
}

}  // namespace

std::vector<size_t> solve_multiple_choice(const std::vector<std::vector<double>>& weights,
                                          const std::vector<std::vector<double>>& costs,
                                          double capacity, int64_t steps) {
  TORCH_CHECK_VALUE(capacity > 0 && std::isfinite(capacity),
                    "ampx::plan: the loss budget must be > 0, got ", capacity);
  TORCH_CHECK_VALUE(steps >= 1, "ampx::plan: budget_steps must be >= 1, got ", steps);
  TORCH_CHECK_VALUE(weights.size() == costs.size(), "ampx::plan: ", weights.size(),
                    " weight groups, ", costs.size(), " cost groups");
  const double unit = capacity / static_cast<double>(steps);
  const size_t groups = weights.size();
  const auto width = static_cast<size_t>(steps) + 1;
  // dp[b]: the best value of the groups so far using at most b steps.
  std::vector<DpValue> dp(width, DpValue{0.0, 0});
  std::vector<std::vector<size_t>> choice(groups, std::vector<size_t>(width, 0));
  for (size_t g = 0; g < groups; ++g) {
    TORCH_CHECK_VALUE(!weights[g].empty() && weights[g].size() == costs[g].size(),
                      "ampx::plan: group ", g, " has ", weights[g].size(), " weights and ",
                      costs[g].size(), " costs");
    std::vector<DpValue> next(width);
    for (size_t i = 0; i < weights[g].size(); ++i) {
      // Rounded up: a plan the program finds feasible is feasible in real numbers.
      const double w = std::max(0.0, weights[g][i]) / unit;
      if (!(w <= static_cast<double>(steps))) continue;  // too heavy (or NaN)
      const auto wi = static_cast<size_t>(std::ceil(w - 1e-9));
      for (size_t b = wi; b < width; ++b) {
        if (!std::isfinite(dp[b - wi].cost)) continue;
        const DpValue v{dp[b - wi].cost + costs[g][i], dp[b - wi].used + static_cast<int64_t>(wi)};
        if (v.better_than(next[b])) {
          next[b] = v;
          choice[g][b] = i;
        }
      }
    }
    dp = std::move(next);
  }
  TORCH_CHECK_VALUE(groups == 0 || std::isfinite(dp[width - 1].cost),
                    "ampx::plan: no assignment fits the loss budget ", capacity);
  std::vector<size_t> picked(groups);
  size_t b = width - 1;
  for (size_t g = groups; g-- > 0;) {
    picked[g] = choice[g][b];
    const double w = std::max(0.0, weights[g][picked[g]]) / unit;
    b -= static_cast<size_t>(std::ceil(w - 1e-9));
  }
  return picked;
}

namespace {

// Why `chosen` of `layer`: what was faster and did not fit, what was faster
// and below the layer's `floor` (nullptr: none), or that nothing was.
std::string reason_for(const LayerMeasurement& layer, const FormatMeasurement& chosen,
                       const CostModel& model, const Floor* floor) {
  const double speed = model.throughput.at(chosen.format);
  std::string unfit, floored;
  for (const auto& f : layer.formats) {
    const auto it = model.throughput.find(f.format);
    if (it == model.throughput.end() || it->second <= speed) continue;
    if (floor && element_bits(f.format) < element_bits(floor->format)) {
      floored += (floored.empty() ? "" : ", ") + to_string(f.format);
    } else {
      unfit += (unfit.empty() ? "" : ", ") + to_string(f.format) + " " + percent(f.loss_change);
    }
  }
  std::ostringstream s;
  s << to_string(chosen.format) << " (" << std::setprecision(3) << speed << "x bf16 on "
    << model.target << ", loss " << percent(chosen.loss_change) << ")";
  if (!unfit.empty()) s << ": faster formats did not fit the budget (" << unfit << ")";
  if (!floored.empty()) {
    s << (unfit.empty() ? ": " : "; ") << "the floor '" << floor->prefix << "' keeps it at "
      << element_bits(floor->format) << "-bit elements or wider (" << to_string(floor->format)
      << "), ruling out " << floored;
  }
  if (!unfit.empty() || !floored.empty()) return s.str();
  if (layer.formats.size() == 1) {
    s << ": no other format measured (dimensions " << layer.in_features << " x "
      << layer.out_features << ", FP8 needs multiples of 16)";
  } else {
    s << ": the fastest format measured that " << model.target << " runs";
  }
  return s.str();
}

// The floor that binds each measured layer (the widest of those over it;
// nullptr: none); c10::Error for a floor over no measured Linear.
std::vector<const Floor*> floors_of(const Measurement& measurement,
                                    const std::vector<Floor>& floors) {
  for (const auto& floor : floors) {
    TORCH_CHECK_VALUE(!floor.prefix.empty(), "ampx::plan::make_plan: a floor (",
                      to_string(floor.format), ") has an empty prefix");
    const bool any = std::any_of(measurement.layers.begin(), measurement.layers.end(),
                                 [&](const LayerMeasurement& layer) {
                                   return detail::is_under(layer.module, floor.prefix);
                                 });
    if (any) continue;
    std::string known;
    for (const auto& layer : measurement.layers) {
      known += (known.empty() ? "" : ", ") + layer.module;
    }
    TORCH_CHECK_VALUE(false, "ampx::plan::make_plan: the floor '", floor.prefix, "' (",
                      to_string(floor.format), ") names no measured Linear (", known, ")");
  }
  std::vector<const Floor*> binding;
  for (const auto& layer : measurement.layers) {
    binding.push_back(detail::binding_floor(layer.module, floors));
  }
  return binding;
}

}  // namespace

PrecisionPlan make_plan(const Measurement& measurement, const PlanOptions& options) {
  TORCH_CHECK_VALUE(options.loss_budget() > 0 && std::isfinite(options.loss_budget()),
                    "ampx::plan::make_plan: loss_budget must be > 0, got ", options.loss_budget());
  TORCH_CHECK_VALUE(options.tail() >= 0 && options.tail() < 1,
                    "ampx::plan::make_plan: tail must be in [0, 1), got ", options.tail());
  const CostModel& model = options.cost_model();
  const auto floors = floors_of(measurement, options.floors());
  std::vector<std::vector<double>> weights, costs;
  std::vector<std::vector<const FormatMeasurement*>> candidates;
  for (size_t l = 0; l < measurement.layers.size(); ++l) {
    const LayerMeasurement& layer = measurement.layers[l];
    weights.emplace_back();
    costs.emplace_back();
    candidates.emplace_back();
    for (const auto& f : layer.formats) {
      const auto it = model.throughput.find(f.format);
      if (it == model.throughput.end() || !(it->second > 0)) continue;  // not on this target
      if (floors[l] && element_bits(f.format) < element_bits(floors[l]->format)) continue;
      weights.back().push_back(f.loss_change);
      costs.back().push_back(layer.flops_share / it->second);
      candidates.back().push_back(&f);
    }
    TORCH_CHECK_VALUE(!candidates.back().empty(), "ampx::plan::make_plan: layer '", layer.module,
                      "' has no format the ", model.target, " cost model runs",
                      floors[l] ? " at or above its floor '" + floors[l]->prefix + "' (" +
                                      to_string(floors[l]->format) + ")"
                                : std::string());
  }
  const auto picked =
      solve_multiple_choice(weights, costs, options.loss_budget(), options.budget_steps());
  PrecisionPlan plan;
  plan.target = model.target;
  plan.reference = measurement.reference;
  plan.loss_budget = options.loss_budget();
  plan.tail = options.tail();
  plan.floors = options.floors();
  plan.cost = 0;
  plan.bf16_cost = 0;
  for (size_t l = 0; l < measurement.layers.size(); ++l) {
    const LayerMeasurement& layer = measurement.layers[l];
    const FormatMeasurement& f = *candidates[l][picked[l]];
    plan.layers.push_back({layer.module, f.format, scale_rule_of(f.format, options.seed()),
                           f.loss_change, f.grad_error, layer.flops_share,
                           reason_for(layer, f, model, floors[l])});
    plan.predicted_loss_change += std::max(0.0, f.loss_change);
    plan.cost += costs[l][picked[l]];
    plan.bf16_cost += layer.flops_share;
  }
  return plan;
}

}  // namespace plan
}  // namespace ampx
