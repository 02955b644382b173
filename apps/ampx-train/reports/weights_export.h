#pragma once

// --export-weights: the trained model's weights as a safetensors file that
// Python's safetensors.torch.load_model loads into bench/python's twin of
// the model (tests/train/export_weights_test.cpp checks the logits, bitwise).
//
//   export_weights(path, *setup.model, *setup.optimizer, setup.fp8_layers, identity);
//   // python: load_model(GPT(...), path)  # strict: the same names and shapes

#include <ampx/fsdp.h>
#include <ampx/optim/optimizer.h>
#include <ampx/zero.h>

#include <torch/nn/module.h>
#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

namespace ampx::train {

struct TrainConfig;

/// The file mode `mode` exports to: --export-weights itself for a single
/// run; under --compare, one per mode, "-<mode>" before the extension (as
/// --profile names its traces): w.safetensors -> w-O2.safetensors.
std::string export_path_for(const TrainConfig& config, const std::string& mode);

/// What --export-weights writes, by name: each parameter as its fp32 master
/// where `optimizer` keeps one (O2), else as the model holds it (fp32, O1,
/// fp8: fp32; O3: the 16-bit weights), and the model's buffers but the FP8
/// layers' scaling state (the "fp8_" buffers of `fp8_layers`: training
/// state, which checkpoints keep; the Python model has none).
std::map<std::string, torch::Tensor> exported_weights(
    const torch::nn::Module& model, const ampx::optim::MixedPrecisionOptimizer& optimizer,
    const std::vector<std::string>& fp8_layers);

/// Writes exported_weights() to `path` (atomically, as save_safetensors
/// does; its folder made if missing), with the run's `identity` (workload,
/// model shape, precision, ...) as the header's metadata, values as
/// strings, and "format": "pt". A failed write throws c10::Error naming
/// the path and the cause ("ampx-train: --export-weights: save_safetensors:
/// cannot write ...").
void export_weights(const std::string& path, const torch::nn::Module& model,
                    const ampx::optim::MixedPrecisionOptimizer& optimizer,
                    const std::vector<std::string>& fp8_layers, const nlohmann::json& identity);
/// The same for a fully sharded model, streamed by rank 0 a unit at a
/// time (FullyShardedDataParallel::save_full_safetensors; `rank0` makes
/// the folder). Collective: an error on rank 0 throws on every rank.
void export_weights(const std::string& path, ampx::dist::FullyShardedDataParallel& fsdp,
                    const nlohmann::json& identity, bool rank0);
/// The same for ZeRO-1's masters of `model`, streamed by rank 0 a piece at
/// a time (ZeroRedundancyOptimizer::save_full_safetensors).
void export_weights(const std::string& path, ampx::dist::ZeroRedundancyOptimizer& zero,
                    const torch::nn::Module& model, const nlohmann::json& identity, bool rank0);

}  // namespace ampx::train
