#include "weights_export.h"

#include "cli/config.h"
#include "profile.h"

#include <ampx/safetensors.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <system_error>

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

namespace {

/// The header's metadata: "format": "pt" and the run's identity.
std::map<std::string, std::string> metadata_of(const nlohmann::json& identity) {
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  for (const auto& [key, value] : identity.items()) {
    metadata[key] = value.is_string() ? value.get<std::string>() : value.dump();
  }
  return metadata;
}

/// Makes `path`'s folder (`rank0` only) and runs `save` with the metadata,
/// its error said as --export-weights'. A folder that cannot be made fails
/// the write on rank 0, which every rank then reports (under a streamed
/// export no rank may leave the collective early); rank 0's error says why
/// the folder could not be made.
void export_with(const std::string& path, const nlohmann::json& identity, bool rank0,
                 const std::function<void(const std::map<std::string, std::string>&)>& save) {
  std::string folder_error;
  if (rank0) {
    const auto folder = std::filesystem::path(path).parent_path();
    std::error_code error;
    if (!folder.empty()) std::filesystem::create_directories(folder, error);
    if (error) {
      folder_error = "; its folder '" + folder.string() + "' could not be made: " + error.message();
    }
  }
  try {
    save(metadata_of(identity));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "ampx-train: --export-weights: ", e.what_without_backtrace(), folder_error);
  }
}

}  // namespace

void export_weights(const std::string& path, const torch::nn::Module& model,
                    const ampx::optim::MixedPrecisionOptimizer& optimizer,
                    const std::vector<std::string>& fp8_layers, const nlohmann::json& identity) {
  const auto weights = exported_weights(model, optimizer, fp8_layers);
  export_with(path, identity, true, [&](const std::map<std::string, std::string>& metadata) {
    ampx::save_safetensors(weights, path, metadata);
  });
}

void export_weights(const std::string& path, ampx::dist::FullyShardedDataParallel& fsdp,
                    const nlohmann::json& identity, bool rank0) {
  export_with(path, identity, rank0, [&](const std::map<std::string, std::string>& metadata) {
    fsdp.save_full_safetensors(path, metadata);
  });
}

void export_weights(const std::string& path, ampx::dist::ZeroRedundancyOptimizer& zero,
                    const torch::nn::Module& model, const nlohmann::json& identity, bool rank0) {
  export_with(path, identity, rank0, [&](const std::map<std::string, std::string>& metadata) {
    zero.save_full_safetensors(path, model, metadata);
  });
}

}  // namespace ampx::train
