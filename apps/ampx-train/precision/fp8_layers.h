#pragma once

// Which Linears an FP8 mode converts, and which --bf16-layers keeps in bf16.

#include "cli/config.h"

#include <torch/nn/module.h>

#include <string>
#include <vector>

namespace ampx::train {

/// The paths of `model`'s Linears that FP8 mode `mode` keeps in bf16, by
/// config.bf16_layers: "none"; a comma-separated list of paths or prefixes
/// (each must name at least one Linear: else c10::Error, naming the model's
/// Linears); or "auto", the published choices: nvfp4 keeps the Linears of
/// the first and last numbered blocks (blocks.0, blocks.<last>) and those
/// outside the blocks (the head), the other modes those outside the blocks
/// only (torchao's and torchtitan's "output" filter), fp8 none. A model
/// without numbered blocks counts its Linears as the blocks: auto keeps
/// its first and last (nvfp4) or its last.
std::vector<std::string> bf16_layers_of(const TrainConfig& config, const std::string& mode,
                                        torch::nn::Module& model);

/// The paths of `model`'s first and last numbered blocks ("blocks.0",
/// "blocks.3"; one when it has one), or, without numbered blocks, of its
/// first and last Linears: the ends nvfp4's --bf16-layers auto keeps in
/// bf16, and those --plan-ends floors.
std::vector<std::string> end_blocks(torch::nn::Module& model);

}  // namespace ampx::train
