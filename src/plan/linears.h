#pragma once

// The Linears of a model by path, and what the measurement and apply_plan
// do to them: copy a model's weights into a fresh one, convert some of its
// Linears to a format. Internal to src/plan/.
//
//   auto linears = ampx::plan::detail::linears_of(model);   // {{"fc1", ptr}, ...}
//   ampx::plan::detail::convert_layers(model, {"fc1"}, LayerFormat::kNvfp4, 0);

#include "ampx/precision_plan.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace torch {
namespace nn {
class LinearImpl;
}  // namespace nn
}  // namespace torch

namespace ampx {
namespace plan {
namespace detail {

/// Every torch::nn::Linear of `model` (itself included) with its path, in module order.
std::vector<std::pair<std::string, torch::nn::LinearImpl*>> linears_of(torch::nn::Module& model);

/// The Linear at `path`; c10::Error starting with "ampx::plan::<caller>"
/// naming the path and the model's Linears when there is none.
torch::nn::LinearImpl* find_linear(
    const std::vector<std::pair<std::string, torch::nn::LinearImpl*>>& linears,
    const std::string& path, const std::string& caller);

/// Whether the module at `path` is at or under `prefix` (a Floor's): "blocks.0"
/// holds "blocks.0" and "blocks.0.fc", not "blocks.01".
bool is_under(const std::string& path, const std::string& prefix);
/// The floor that binds the module at `path`: the widest of `floors` over it
/// (the first of equals); nullptr when none is.
const Floor* binding_floor(const std::string& path, const std::vector<Floor>& floors);

/// Whether `format` runs as a wide product (fp32, fp16), not autocast or FP8.
bool is_wide(LayerFormat format);
/// Whether `format` is one of the FP8 and FP4 recipes.
bool is_fp8(LayerFormat format);

/// Whether a Linear of these dimensions may take an FP8 or FP4 format: both
/// multiples of 16, what FP8 tensor cores take (ampx-train's filter too).
bool fp8_eligible(int64_t in_features, int64_t out_features);

/// Copies the parameters and buffers of `from` into `to` (same names and
/// shapes, else c10::Error naming the first that differs).
void copy_weights(torch::nn::Module& from, torch::nn::Module& to);

/// Converts the Linears at `paths` of `model` to `format`: an FP8 recipe,
/// or a wide product for fp32 and fp16 (nothing for bf16).
void convert_layers(torch::nn::Module& model, const std::vector<std::string>& paths,
                    LayerFormat format, uint64_t seed);

}  // namespace detail
}  // namespace plan
}  // namespace ampx
