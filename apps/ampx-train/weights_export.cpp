#include "weights_export.h"

#include "config.h"
#include "profile.h"

#include <ampx/safetensors.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>

namespace ampx::train {

std::string export_path_for(const TrainConfig& config, const std::string& mode) {
  return profile_path_for(config.export_weights, mode, !config.compare.empty());
}

std::map<std::string, torch::Tensor> exported_weights(
    const torch::nn::Module& model, const ampx::optim::MixedPrecisionOptimizer& optimizer,
    const std::vector<std::string>& fp8_layers) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    const torch::Tensor master = optimizer.master(p.value());  // undefined: fp32, or no masters
    out[p.key()] = master.defined() ? master : p.value();
  }
  const auto scaling_state = [&](const std::string& name) {
    return std::any_of(fp8_layers.begin(), fp8_layers.end(), [&](const std::string& layer) {
      return name.rfind(layer + ".fp8_", 0) == 0;
    });
  };
  for (const auto& b : model.named_buffers(/*recurse=*/true)) {
    if (!scaling_state(b.key())) out[b.key()] = b.value();
  }
  return out;
}

void export_weights(const std::string& path, const torch::nn::Module& model,
                    const ampx::optim::MixedPrecisionOptimizer& optimizer,
                    const std::vector<std::string>& fp8_layers, const nlohmann::json& identity) {
  export_weights(path, exported_weights(model, optimizer, fp8_layers), identity);
}

namespace {

/// The header's metadata: "format": "pt" and the run's identity.
std::map<std::string, std::string> metadata_of(const nlohmann::json& identity) {
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  for (const auto& [key, value] : identity.items()) {
    metadata[key] = value.is_string() ? value.get<std::string>() : value.dump();
  }
  return metadata;
}

void make_folder_of(const std::string& path) {
  const auto folder = std::filesystem::path(path).parent_path();
  if (!folder.empty()) std::filesystem::create_directories(folder);
}

}  // namespace

void export_weights(const std::string& path, const std::map<std::string, torch::Tensor>& weights,
                    const nlohmann::json& identity) {
  make_folder_of(path);
  try {
    ampx::save_safetensors(weights, path, metadata_of(identity));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "ampx-train: --export-weights: ", e.what_without_backtrace());
  }
}

void export_weights(const std::string& path, ampx::dist::FullyShardedDataParallel& fsdp,
                    const nlohmann::json& identity, bool rank0) {
  if (rank0) {
    // A folder that cannot be made fails the write on rank 0, which every
    // rank then reports: no rank may leave the collective early.
    std::error_code ignored;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ignored);
  }
  try {
    fsdp.save_full_safetensors(path, metadata_of(identity));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "ampx-train: --export-weights: ", e.what_without_backtrace());
  }
}

}  // namespace ampx::train
