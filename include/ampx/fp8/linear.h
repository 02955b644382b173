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
// Execution: CPU and every device here emulate FP8 exactly (cast to the FP8
// grid, multiply in float32). The numbers are what the recipe defines; the
// speed is not the point (docs/fp8.md).
//
// The scaling states (amax histories, scales, scale_invs of input, weight
// and output gradient) are buffers of the module: torch::save / torch::load
// of the model keep them bitwise. The module must outlive the backward of
// the forward it ran (its output-gradient state is updated there).

#include "ampx/fp8/scaling.h"

#include <c10/util/Optional.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>

namespace ampx {
namespace fp8 {

struct LinearOptions {
  LinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  /// The delayed-scaling recipe of the three states.
  TORCH_ARG(DelayedScaling, recipe) = DelayedScaling();
  /// Output dtype in a region; unset: the autocast dtype of the input's device
  /// when autocast is on there, else bfloat16.
  TORCH_ARG(c10::optional<c10::ScalarType>, output_dtype) = c10::nullopt;
};

/// Turns FP8 on for ampx::fp8::Linear layers run on this thread (and by
/// autograd for them) while alive; nests, and restores the previous state.
class Fp8AutocastGuard {
 public:
  explicit Fp8AutocastGuard(bool enabled = true);
  ~Fp8AutocastGuard();
  Fp8AutocastGuard(const Fp8AutocastGuard&) = delete;
  Fp8AutocastGuard& operator=(const Fp8AutocastGuard&) = delete;

 private:
  bool previous_;
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

  DelayedScalingState& input_state() { return *input_state_; }
  DelayedScalingState& weight_state() { return *weight_state_; }
  DelayedScalingState& grad_output_state() { return *grad_output_state_; }

 private:
  std::shared_ptr<DelayedScalingState> input_state_, weight_state_, grad_output_state_;
};
TORCH_MODULE(Linear);

}  // namespace fp8
}  // namespace ampx
