// Applying a plan: each planned Linear converted to its format.

#include "ampx/precision_plan.h"

#include "linears.h"

#include <map>

namespace ampx {
namespace plan {

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

}  // namespace plan
}  // namespace ampx
