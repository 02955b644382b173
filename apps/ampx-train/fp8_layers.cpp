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

std::vector<std::string> auto_layers(const std::string& mode,
                                     const std::vector<std::string>& linears) {
  if (mode == "fp8") return {};
  std::vector<std::string> blocks, keep;
  for (const auto& l : linears) {
    const std::string b = numbered_block(l);
    if (!b.empty() && std::find(blocks.begin(), blocks.end(), b) == blocks.end()) {
      blocks.push_back(b);
    }
  }
  if (blocks.empty()) {  // every Linear its own block
    if (linears.empty()) return {};
    if (mode == "nvfp4") keep.push_back(linears.front());
    if (linears.size() > 1 || mode != "nvfp4") keep.push_back(linears.back());
    return keep;
  }
  for (const auto& l : linears) {
    const std::string b = numbered_block(l);
    const bool edge = mode == "nvfp4" && (b == blocks.front() || b == blocks.back());
    if (b.empty() || edge) keep.push_back(l);
  }
  return keep;
}

}  // namespace

std::vector<std::string> bf16_layers_of(const TrainConfig& config, const std::string& mode,
                                        torch::nn::Module& model) {
  std::vector<std::string> linears;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (dynamic_cast<torch::nn::LinearImpl*>(item.value().get())) linears.push_back(item.key());
  }
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
