#include "linears.h"

#include "ampx/fp8/convert.h"
#include "../fp8/convert_internal.h"

#include <torch/torch.h>

#include <algorithm>

namespace ampx {
namespace plan {
namespace detail {

std::vector<std::pair<std::string, torch::nn::LinearImpl*>> linears_of(torch::nn::Module& model) {
  std::vector<std::pair<std::string, torch::nn::LinearImpl*>> out;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(item.value().get())) {
      out.emplace_back(item.key(), linear);
    }
  }
  return out;
}

torch::nn::LinearImpl* find_linear(
    const std::vector<std::pair<std::string, torch::nn::LinearImpl*>>& linears,
    const std::string& path, const std::string& caller) {
  std::string known;
  for (const auto& [name, linear] : linears) {
    if (name == path) return linear;
    known += (known.empty() ? "" : ", ") + name;
  }
  TORCH_CHECK_VALUE(false, "ampx::plan::", caller, ": module '", path,
                    "' is not a Linear of the model (its Linears: ", known, ")");
}

bool is_under(const std::string& path, const std::string& prefix) {
  return path == prefix || path.rfind(prefix + ".", 0) == 0;
}

const Floor* binding_floor(const std::string& path, const std::vector<Floor>& floors) {
  const Floor* binding = nullptr;
  for (const auto& floor : floors) {
    if (!is_under(path, floor.prefix)) continue;
    if (!binding || element_bits(floor.format) > element_bits(binding->format)) binding = &floor;
  }
  return binding;
}

bool is_wide(LayerFormat format) {
  return format == LayerFormat::kFloat32 || format == LayerFormat::kFloat16;
}

bool is_fp8(LayerFormat format) {
  return format != LayerFormat::kBFloat16 && !is_wide(format);
}

bool fp8_eligible(int64_t in_features, int64_t out_features) {
  return in_features % 16 == 0 && out_features % 16 == 0;
}

void copy_weights(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto copy = [](const auto& source, auto target, const char* kind) {
    TORCH_CHECK_VALUE(source.size() == target.size(), "ampx::plan: make_model's model has ",
                      target.size(), " ", kind, ", the measured model ", source.size());
    for (const auto& item : source) {
      const at::Tensor* t = target.find(item.key());
      TORCH_CHECK_VALUE(t != nullptr && t->sizes() == item.value().sizes(),
                        "ampx::plan: make_model's model differs from the measured one at ", kind,
                        " '", item.key(), "'");
      at::Tensor(*t).copy_(item.value());
    }
  };
  copy(from.named_parameters(), to.named_parameters(), "parameters");
  copy(from.named_buffers(), to.named_buffers(), "buffers");
}

void convert_layers(torch::nn::Module& model, const std::vector<std::string>& paths,
                    LayerFormat format, uint64_t seed) {
  if (format == LayerFormat::kBFloat16 || paths.empty()) return;
  if (is_wide(format)) {
    const auto linears = linears_of(model);
    for (const auto& path : paths) {
      fp8::detail::set_wide_product(*find_linear(linears, path, "convert"),
                                    format == LayerFormat::kFloat32 ? at::kFloat : at::kHalf);
    }
    return;
  }
  const auto filter = [&paths](const std::string& path, const torch::nn::LinearImpl&) {
    return std::find(paths.begin(), paths.end(), path) != paths.end();
  };
  fp8::convert_linears(model, fp8::ConvertOptions().recipe(recipe_of(format, seed)).filter(filter));
}

}  // namespace detail
}  // namespace plan
}  // namespace ampx
