#include "fp8_layers.h"

#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <cctype>
#include <sstream>

namespace ampx::train {
namespace {

// "blocks.3" of "blocks.3.attn.qkv": the path up to its first numeric part;
// "" when it has none (a head, a top-level layer).
std::string numbered_block(const std::string& path) {
  std::istringstream parts(path);
  std::string part, prefix;
  while (std::getline(parts, part, '.')) {
    prefix += (prefix.empty() ? "" : ".") + part;
    if (!part.empty() && std::all_of(part.begin(), part.end(),
                                     [](unsigned char ch) { return std::isdigit(ch); })) {
      return prefix;
    }
  }
  return "";
}

bool under(const std::string& path, const std::string& prefix) {
  return path == prefix || path.rfind(prefix + ".", 0) == 0;
}

// The first and last numbered blocks of `linears`, or without any, the
// first and last of them (each its own block); one when they are the same.
std::vector<std::string> ends_of(const std::vector<std::string>& linears) {
  std::vector<std::string> blocks;
  for (const auto& l : linears) {
    const std::string b = numbered_block(l);
    if (!b.empty() && std::find(blocks.begin(), blocks.end(), b) == blocks.end()) {
      blocks.push_back(b);
    }
  }
  if (blocks.empty()) blocks = linears;
  if (blocks.size() <= 1) return blocks;
  return {blocks.front(), blocks.back()};
}

std::vector<std::string> auto_layers(const std::string& mode,
                                     const std::vector<std::string>& linears) {
  if (mode == "fp8") return {};
  const bool numbered = std::any_of(linears.begin(), linears.end(), [](const std::string& l) {
    return !numbered_block(l).empty();
  });
  if (!numbered) {  // every Linear its own block
    if (linears.empty()) return {};
    return mode == "nvfp4" ? ends_of(linears) : std::vector<std::string>{linears.back()};
  }
  const auto ends = mode == "nvfp4" ? ends_of(linears) : std::vector<std::string>();
  std::vector<std::string> keep;
  for (const auto& l : linears) {
    const std::string b = numbered_block(l);
    if (b.empty() || std::find(ends.begin(), ends.end(), b) != ends.end()) keep.push_back(l);
  }
  return keep;
}

std::vector<std::string> linear_paths(torch::nn::Module& model) {
  std::vector<std::string> linears;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (dynamic_cast<torch::nn::LinearImpl*>(item.value().get())) linears.push_back(item.key());
  }
  return linears;
}

}  // namespace

std::vector<std::string> end_blocks(torch::nn::Module& model) {
  return ends_of(linear_paths(model));
}

std::vector<std::string> bf16_layers_of(const TrainConfig& config, const std::string& mode,
                                        torch::nn::Module& model) {
  const std::vector<std::string> linears = linear_paths(model);
  if (config.bf16_layers == "auto") return auto_layers(mode, linears);
  if (config.bf16_layers == "none") return {};
  std::vector<std::string> keep;
  std::istringstream list(config.bf16_layers);
  std::string prefix;
  while (std::getline(list, prefix, ',')) {
    if (prefix.empty()) continue;
    bool any = false;
    for (const auto& l : linears) {
      if (!under(l, prefix)) continue;
      any = true;
      if (std::find(keep.begin(), keep.end(), l) == keep.end()) keep.push_back(l);
    }
    std::string known;
    for (const auto& l : linears) known += (known.empty() ? "" : ", ") + l;
    TORCH_CHECK(any, "ampx-train: --bf16-layers '", prefix, "' names no Linear of this model (",
                known, ")");
  }
  return keep;
}

}  // namespace ampx::train
