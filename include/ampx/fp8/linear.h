#pragma once

/// \file
/// An FP8 drop-in for torch::nn::Linear, after Transformer Engine's
/// te.Linear with delayed scaling, and the region that turns it on:
///
/// ```
///   ampx::fp8::Linear fc(ampx::fp8::LinearOptions(768, 3072));
///   {
///     ampx::fp8::Fp8AutocastGuard fp8;           // TE's fp8_autocast(enabled=True)
///     auto y = fc->forward(x);                   // bf16 (or the autocast dtype)
///     y.sum().backward();
///   }
///   fc->forward(x);                              // outside the region: a plain linear
/// ```
///
/// Inside a region, forward casts the input and the weight to E4M3 with the
/// scales of their delayed-scaling states (the amax history of the steps
/// before), multiplies the cast values with float32 accumulation, adds the
/// bias, and records both amaxes for the next step's scales. Backward casts
/// the output gradient to E5M2 (HYBRID; E4M3 with an E4M3 recipe) and uses it
/// in both products: grad_input = g8 @ w8 and grad_weight = g8^T @ x8, with
/// the FP8 input and weight that forward saved (codes, one byte each). The
/// bias gradient is the sum of the unquantized output gradient, as TE does.
/// The weight stays float32 (the master), updated by any optimizer.
///
/// Execution: the CPU emulates FP8 exactly (cast to the FP8 grid, multiply in
/// float32): the numbers are what the recipe defines, the speed is not the
/// point (docs/fp8.md). CUDA tensors on LibTorch 2.5+ multiply on FP8 tensor
/// cores through at::_scaled_mm where the device and the shapes allow it
/// (every dimension a multiple of 16), and emulate otherwise.
///
/// The scaling states (amax histories, scales, scale_invs of input, weight
/// and output gradient) are buffers of the module: torch::save / torch::load
/// of the model keep them bitwise. A forward without gradients (evaluation)
/// casts with them and records nothing.
///
/// The region is ampx/fp8/autocast.h's (Fp8AutocastGuard, with TE's amax
/// reduction across data-parallel ranks); convert_linears(model) in
/// ampx/fp8/convert.h gives a model's existing torch::nn::Linear layers the
/// same behaviour in place; the per-role scaling states (TensorScaling,
/// LinearScaling) are ampx/fp8/scaling.h's. This header includes all three.

#include "ampx/fp8/autocast.h"
#include "ampx/fp8/convert.h"
#include "ampx/fp8/scaling.h"

#include <c10/util/Optional.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>

namespace ampx {
namespace fp8 {

/// An FP8 Linear's shape and recipe, set by chained calls as
/// torch::nn::LinearOptions: `LinearOptions(768, 3072).bias(false)`.
struct LinearOptions {
  /// A layer from `in_features` to `out_features`, the rest as below.
  LinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  /// Size of each input's last dimension (> 0).
  TORCH_ARG(int64_t, in_features);
  /// Size of each output's last dimension (> 0).
  TORCH_ARG(int64_t, out_features);
  /// Whether the layer adds a learned bias.
  TORCH_ARG(bool, bias) = true;
  /// The scaling recipe: DelayedScaling (default, TE's defaults),
  /// CurrentScaling, or a block-scaled one (ampx/fp8/block_recipe.h).
  TORCH_ARG(Recipe, recipe) = Recipe();
  /// Output dtype in a region; unset: the autocast dtype of the input's device
  /// when autocast is on there, else bfloat16.
  TORCH_ARG(c10::optional<c10::ScalarType>, output_dtype) = c10::nullopt;
};

/// The FP8 linear layer (the top of this header); use it through its holder
/// Linear, as torch::nn::LinearImpl through torch::nn::Linear.
class LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  /// LinearImpl(LinearOptions(in_features, out_features)).
  LinearImpl(int64_t in_features, int64_t out_features)
      : LinearImpl(LinearOptions(in_features, out_features)) {}
  /// A layer as `options` say, initialised as torch::nn::Linear is.
  explicit LinearImpl(const LinearOptions& options);

  /// Registers weight, bias and the scaling states' buffers anew and
  /// initialises them as torch::nn::Linear does (kaiming-uniform weight,
  /// uniform bias); the states start over.
  void reset() override;
  /// x: [..., in_features] floating -> [..., out_features].
  at::Tensor forward(const at::Tensor& x);

  LinearOptions options;  ///< the options the layer was made with
  at::Tensor weight;  ///< [out, in] float32 master
  at::Tensor bias;    ///< [out] or undefined

  /// The scaling of the three roles (input, weight, output gradient).
  LinearScaling& scaling() { return *scaling_; }
  /// The delayed-scaling states (throw c10::Error under another recipe).
  DelayedScalingState& input_state();
  /// The weight's delayed-scaling state (as input_state()).
  DelayedScalingState& weight_state();
  /// The output gradient's delayed-scaling state (as input_state()).
  DelayedScalingState& grad_output_state();

 private:
  friend std::shared_ptr<LinearScaling> scaling_of(torch::nn::Module& module);
  std::shared_ptr<LinearScaling> scaling_;
};
/// LinearImpl's module holder (a shared pointer): `fc->forward(x)`.
TORCH_MODULE(Linear);

namespace detail {
/// How many FP8 products ran on tensor cores (at::_scaled_mm) in this process.
/// (Here only because tests/ and bench/ count them and do not see src/.)
int64_t scaled_mm_calls();
/// How many weight casts TensorScaling::cast_weight made (not gave again)
/// under WeightCasts::kFirstMicroBatch or kLaterMicroBatch in this process.
int64_t weight_casts();
}  // namespace detail

}  // namespace fp8
}  // namespace ampx
