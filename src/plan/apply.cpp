// Applying a plan: each planned Linear converted to its format; and its
// tail, every planned Linear back in the reference's format.

#include "ampx/precision_plan.h"

#include "ampx/fp8/convert.h"
#include "../fp8/convert_internal.h"
#include "linears.h"

#include <torch/torch.h>

#include <cmath>
#include <map>

namespace ampx {
namespace plan {
namespace {

void check_tail(const PrecisionPlan& plan, const char* caller) {
  TORCH_CHECK_VALUE(plan.tail >= 0 && plan.tail < 1, "ampx::plan::", caller,
                    ": the plan's tail must be in [0, 1), got ", plan.tail);
}

}  // namespace

std::vector<std::string> apply_plan(torch::nn::Module& model, const PrecisionPlan& plan,
                                    uint64_t seed) {
  const auto linears = detail::linears_of(model);
  std::map<LayerFormat, std::vector<std::string>> by_format;
  for (const auto& l : plan.layers) {
    detail::find_linear(linears, l.module, "apply_plan");  // throws on an unknown module
    if (l.format != LayerFormat::kBFloat16) by_format[l.format].push_back(l.module);
  }
  std::vector<std::string> converted;
  for (const auto& [format, paths] : by_format) {
    detail::convert_layers(model, paths, format, seed);
    converted.insert(converted.end(), paths.begin(), paths.end());
  }
  return converted;
}

int64_t tail_start(const PrecisionPlan& plan, int64_t total_steps) {
  check_tail(plan, "tail_start");
  TORCH_CHECK_VALUE(total_steps >= 0, "ampx::plan::tail_start: total_steps must be >= 0, got ",
                    total_steps);
  return total_steps - std::llround(plan.tail * static_cast<double>(total_steps));
}

void enter_tail(torch::nn::Module& model, const PrecisionPlan& plan) {
  check_tail(plan, "enter_tail");
  TORCH_CHECK_VALUE(
      plan.reference == LayerFormat::kBFloat16 || plan.reference == LayerFormat::kFloat32,
      "ampx::plan::enter_tail: the plan's reference must be bf16 or fp32, got ",
      to_string(plan.reference));
  const auto linears = detail::linears_of(model);
  std::vector<std::string> paths;
  for (const auto& l : plan.layers) {
    auto* linear = detail::find_linear(linears, l.module, "enter_tail");
    if (plan.reference == LayerFormat::kFloat32) {
      paths.push_back(l.module);
    } else if (fp8::scaling_of(*linear) || fp8::detail::wide_product_of(*linear)) {
      fp8::reconvert_linear(*linear, c10::nullopt);  // a plain Linear, for bf16 autocast
    }
  }
  detail::convert_layers(model, paths, LayerFormat::kFloat32, 0);
}

double run_cost(const PrecisionPlan& plan, const CostModel& model) {
  check_tail(plan, "run_cost");
  double reference = plan.bf16_cost;
  if (plan.reference != LayerFormat::kBFloat16 && plan.tail > 0) {
    const auto it = model.throughput.find(plan.reference);
    TORCH_CHECK_VALUE(it != model.throughput.end() && it->second > 0, "ampx::plan::run_cost: the ",
                      model.target, " cost model has no throughput for the plan's reference, ",
                      to_string(plan.reference));
    reference = 0;
    for (const auto& l : plan.layers) reference += l.flops_share / it->second;
  }
  return (1 - plan.tail) * plan.cost + plan.tail * reference;
}

}  // namespace plan
}  // namespace ampx
