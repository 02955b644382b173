#pragma once

// An FP8 drop-in for torch::nn::Linear, after Transformer Engine's
// te.Linear with delayed scaling, and the region that turns it on:
//
//   ampx::fp8::Linear fc(ampx::fp8::LinearOptions(768, 3072));
//   {
//     ampx::fp8::Fp8AutocastGuard fp8;           // TE's fp8_autocast(enabled=True)
//     auto y = fc->forward(x);                   // bf16 (or the autocast dtype)
//     y.sum().backward();
//   }
//   fc->forward(x);                              // outside the region: a plain linear
//
// Inside a region, forward casts the input and the weight to E4M3 with the
// scales of their delayed-scaling states (the amax history of the steps
// before), multiplies the cast values with float32 accumulation, adds the
// bias, and records both amaxes for the next step's scales. Backward casts
// the output gradient to E5M2 (HYBRID; E4M3 with an E4M3 recipe) and uses it
// in both products: grad_input = g8 @ w8 and grad_weight = g8^T @ x8, with
// the FP8 input and weight that forward saved (codes, one byte each). The
// bias gradient is the sum of the unquantized output gradient, as TE does.
// The weight stays float32 (the master), updated by any optimizer.
//
// Execution: the CPU emulates FP8 exactly (cast to the FP8 grid, multiply in
// float32): the numbers are what the recipe defines, the speed is not the
// point (docs/fp8.md). CUDA tensors on LibTorch 2.5+ multiply on FP8 tensor
// cores through at::_scaled_mm where the device and the shapes allow it
// (every dimension a multiple of 16), and emulate otherwise.
//
// The scaling states (amax histories, scales, scale_invs of input, weight
// and output gradient) are buffers of the module: torch::save / torch::load
// of the model keep them bitwise. A forward without gradients (evaluation)
// casts with them and records nothing.
//
// convert_linears(model) gives a model's existing torch::nn::Linear layers
// the same behaviour in place (see below); Fp8AutocastOptions carries TE's
// amax reduction across data-parallel ranks.

#include "ampx/fp8/scaling.h"

#include <c10/util/Optional.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch {
namespace nn {
class LinearImpl;
}  // namespace nn
}  // namespace torch

namespace ampx {
namespace dist {
class ProcessGroup;
}  // namespace dist

namespace fp8 {

/// The scaling of one tensor role of an FP8 layer (its input, its weight or
/// its output gradient) under the layer's recipe. Delayed scaling: the cast
/// uses the scale the history of the steps before gives, and each cast's
/// amax feeds the next. Current scaling: each cast uses its own amax; the
/// tensors below then hold the last cast's amax, scale and scale_inv.
class TensorScaling : public std::enable_shared_from_this<TensorScaling> {
 public:
  TensorScaling(const Recipe& recipe, Pass pass, c10::Device device);

  const Recipe& recipe() const { return recipe_; }
  Fp8Format format() const { return format_; }
  /// The delayed-scaling state; throws c10::Error under current scaling.
  DelayedScalingState& delayed_state();
  /// float32 [1]. Delayed: the scale the next cast uses. Current: the last cast's.
  const at::Tensor& scale() const;
  const at::Tensor& scale_inv() const;
  /// float32 [1]: the amax of the last recorded cast (after the amax
  /// reduction, where there is one); 0 before the first.
  const at::Tensor& last_amax() const { return last_amax_; }
  /// The tensors that make up the state, by name suffix (for module buffers):
  /// delayed: amax_history, scale, scale_inv; current: amax, scale, scale_inv.
  std::vector<std::pair<std::string, at::Tensor>> state_tensors() const;

  /// Casts x (any floating dtype) with this role's scale: one-byte codes and
  /// the scale_inv they decode with. When `record`, the amax of x is
  /// recorded: at once, or, while `group` is set, at the next reduction
  /// (see Fp8AutocastOptions::amax_reduction_group).
  struct Cast {
    at::Tensor codes;
    at::Tensor scale_inv;
  };
  Cast cast(const at::Tensor& x, bool record, const dist::ProcessGroup* group);
  /// Records an amax: delayed scaling updates the history and the next scale.
  void record(const at::Tensor& amax);

 private:
  Recipe recipe_;
  Fp8Format format_;
  std::unique_ptr<DelayedScalingState> delayed_;
  at::Tensor last_amax_, scale_, scale_inv_;  // current scaling (scale_: delayed's own)
};

/// The three roles of an FP8 linear layer, all under one recipe.
struct LinearScaling {
  LinearScaling(const Recipe& recipe, c10::Device device);
  Recipe recipe;
  std::shared_ptr<TensorScaling> input, weight, grad_output;
  /// Registers every state tensor as a buffer of `module`, named
  /// `<prefix><role>_<suffix>` (e.g. "fp8_input_amax_history"), so that
  /// torch::save/load and .to(device) carry them.
  void register_buffers(torch::nn::Module& module, const std::string& prefix) const;
};

struct LinearOptions {
  LinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  /// The scaling recipe of the three roles: DelayedScaling (default, TE's
  /// defaults) or CurrentScaling.
  TORCH_ARG(Recipe, recipe) = Recipe();
  /// Output dtype in a region; unset: the autocast dtype of the input's device
  /// when autocast is on there, else bfloat16.
  TORCH_ARG(c10::optional<c10::ScalarType>, output_dtype) = c10::nullopt;
};

/// What a region carries besides being on.
struct Fp8AutocastOptions {
  using GroupPtr = const dist::ProcessGroup*;
  TORCH_ARG(bool, enabled) = true;
  /// TE's reduce_amax over fp8_group: every FP8 cast's amax is max-reduced
  /// over this group's ranks before it updates a delayed-scaling history, so
  /// the states (and the next casts) are the same on every rank. Forward
  /// amaxes are reduced in one all-reduce when the region ends, output-
  /// gradient amaxes in one when the backward that produced them ends. Null:
  /// each rank keeps its own. The group must outlive the region and the
  /// backward. Not for current scaling (each tensor scales itself).
  TORCH_ARG(GroupPtr, amax_reduction_group) = nullptr;
};

/// Turns FP8 on for ampx::fp8::Linear layers and converted torch::nn::Linear
/// layers run on this thread (and by autograd for them) while alive; nests,
/// and restores the previous state. TE's fp8_autocast(enabled, fp8_group);
/// the recipe belongs to each layer (see docs/fp8.md).
class Fp8AutocastGuard {
 public:
  explicit Fp8AutocastGuard(bool enabled = true);
  explicit Fp8AutocastGuard(const Fp8AutocastOptions& options);
  ~Fp8AutocastGuard() noexcept(false);
  Fp8AutocastGuard(const Fp8AutocastGuard&) = delete;
  Fp8AutocastGuard& operator=(const Fp8AutocastGuard&) = delete;

 private:
  struct Region;
  std::unique_ptr<Region> region_;
};

/// Whether an Fp8AutocastGuard is enabled on this thread.
bool is_fp8_enabled();

class LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  LinearImpl(int64_t in_features, int64_t out_features)
      : LinearImpl(LinearOptions(in_features, out_features)) {}
  explicit LinearImpl(const LinearOptions& options);

  void reset() override;
  /// x: [..., in_features] floating -> [..., out_features].
  at::Tensor forward(const at::Tensor& x);

  LinearOptions options;
  at::Tensor weight;  ///< [out, in] float32 master
  at::Tensor bias;    ///< [out] or undefined

  LinearScaling& scaling() { return *scaling_; }
  /// The delayed-scaling states (throw c10::Error under current scaling).
  DelayedScalingState& input_state() { return scaling_->input->delayed_state(); }
  DelayedScalingState& weight_state() { return scaling_->weight->delayed_state(); }
  DelayedScalingState& grad_output_state() { return scaling_->grad_output->delayed_state(); }

 private:
  friend std::shared_ptr<LinearScaling> scaling_of(torch::nn::Module& module);
  std::shared_ptr<LinearScaling> scaling_;
};
TORCH_MODULE(Linear);

/// Which torch::nn::Linear layers convert_linears() turns to FP8.
struct ConvertOptions {
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

/// The scaling of an FP8 layer: an ampx::fp8::Linear or a converted
/// torch::nn::Linear; null for any other module.
std::shared_ptr<LinearScaling> scaling_of(torch::nn::Module& module);

namespace detail {
/// How many FP8 products ran on tensor cores (at::_scaled_mm) in this process.
int64_t scaled_mm_calls();

/// y = FP8(x) @ FP8(weight)^T + bias with `scaling`, in `out_dtype`; the
/// autograd function both layer kinds run.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      const std::shared_ptr<LinearScaling>& scaling,
                      const c10::optional<c10::ScalarType>& output_dtype);
}  // namespace detail

}  // namespace fp8
}  // namespace ampx
