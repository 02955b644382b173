#pragma once

/// \file
/// FP8 for a model's existing torch::nn::Linear layers, in place: after
/// convert_linears, an Fp8AutocastGuard region runs them as ampx::fp8::Linear
/// runs (see ampx/fp8/linear.h), through a dispatcher kernel that catches
/// at::linear (and the addmm/matmul that torch::nn::Linear's forward calls)
/// when the weight is a converted layer's:
///
/// ```
///   auto paths = ampx::fp8::convert_linears(*model);   // {"fc1", "fc2"}
///   {
///     ampx::fp8::Fp8AutocastGuard fp8;
///     model->forward(x);                                // fc1, fc2 in FP8
///   }
///   ampx::fp8::scaling_of(*model->fc1);                 // its LinearScaling
/// ```

#include "ampx/fp8/scaling.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace torch {
namespace nn {
class LinearImpl;
class Module;
}  // namespace nn
}  // namespace torch

namespace ampx {
namespace fp8 {

/// Which torch::nn::Linear layers convert_linears() turns to FP8.
struct ConvertOptions {
  /// The scaling recipe of every converted layer, as LinearOptions::recipe.
  TORCH_ARG(Recipe, recipe) = Recipe();
  /// Output dtype in a region, as LinearOptions::output_dtype.
  TORCH_ARG(c10::optional<c10::ScalarType>, output_dtype) = c10::nullopt;
  /// Called with each Linear's path (e.g. "blocks.0.fc") and the layer;
  /// unset: every Linear whose in_features and out_features are multiples
  /// of 16 (what FP8 tensor cores take; torchao's default filter too).
  TORCH_ARG(std::function<bool(const std::string&, const torch::nn::LinearImpl&)>,
            filter) = nullptr;
};

/// Turns the torch::nn::Linear layers of `model` (and `model` itself if it is
/// one) into FP8 layers, in place and without replacing them: inside an
/// Fp8AutocastGuard, every at::linear call whose weight is a converted
/// layer's weight (torch::nn::Linear's forward, or a user's own
/// F::linear(x, fc->weight, fc->bias)) runs as ampx::fp8::Linear's does.
/// Each converted layer gets its scaling state as buffers "fp8_input_*",
/// "fp8_weight_*", "fp8_grad_output_*", so checkpoints of the model carry
/// them (convert before loading one). The weight keeps its dtype and its
/// identity: ampx::initialize before or after, O2's fp32 masters included.
/// Returns the converted layers' paths. Converting a layer twice is an error.
std::vector<std::string> convert_linears(torch::nn::Module& model,
                                         const ConvertOptions& options = ConvertOptions());

/// Changes a layer convert_linears() converted (`module`, a
/// torch::nn::Linear) to `recipe`, its scaling starting afresh, or, with
/// c10::nullopt, turns it back into a plain Linear (outside FP8, as if never
/// converted). The buffers its conversion registered stay on it, so a
/// checkpoint of the model keeps loading into a model converted as the
/// first time. c10::Error if `module` is no converted Linear.
void reconvert_linear(torch::nn::Module& module, const c10::optional<Recipe>& recipe);

/// The scaling of an FP8 layer: an ampx::fp8::Linear or a converted
/// torch::nn::Linear; null for any other module.
std::shared_ptr<LinearScaling> scaling_of(torch::nn::Module& module);

}  // namespace fp8
}  // namespace ampx
