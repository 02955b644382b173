#pragma once

/// \file
/// The block-scaled recipes of an FP8 layer, after Transformer Engine 2.x's
/// `MXFP8BlockScaling`, `NVFP4BlockScaling` and `Float8BlockScaling`: what
/// fp8::Linear and convert_linears take as their `recipe`, beside delayed and
/// current scaling (ampx/fp8/scaling.h's Recipe converts from each).
///
/// ```
///   ampx::fp8::Linear fc(ampx::fp8::LinearOptions(768, 3072)
///                            .recipe(ampx::fp8::NVFP4BlockScaling()));
/// ```
///
/// Each product of the layer (forward y = x w^T, input gradient g w, weight
/// gradient g^T x) takes its two operands quantized in blocks along that
/// product's inner dimension, each from the unquantized tensor (TE's
/// row-wise and column-wise copies), and multiplies them as a block-scaled
/// product does: block values summed in float32, times the tensor scales
/// (ampx/fp8/block.h's block_scaled_mm). A weight in 2-D blocks is quantized
/// once and serves both of its products. The bias gradient is the sum of
/// the unquantized output gradient, as TE does. Stateless but for NVFP4's
/// stochastic rounding, whose stream position is a buffer of the layer
/// (`<prefix>rounding`), so that a checkpoint resumes bit for bit.
///
/// These recipes are emulated exactly on the CPU and on CUDA (codes and
/// scales as the recipes define them, the same on both; products of the
/// block values in float32, on CUDA by at::mm, whose sums' order alone
/// differs from the CPU's).

#include "ampx/fp8/block.h"
#include "ampx/fp8/cast.h"

#include <torch/arg.h>

#include <cstdint>
#include <string>

namespace ampx {
namespace fp8 {

/// TE's MXFP8BlockScaling: E4M3 (or E5M2 for gradients) elements, one E8M0
/// scale per 1 x 32 along each product's inner dimension.
struct MXFP8BlockScaling {
  /// Throws c10::Error on invalid options (pure E5M2, a rule without E8M0 scales).
  void validate() const;
  /// "mxfp8(e4m3, rceil)", "mxfp8(hybrid, rceil, 32x32 weights)".
  std::string to_string() const;

  /// E4M3 (TE's default) or HYBRID (E5M2 gradients); E5M2 is refused.
  TORCH_ARG(RecipeFormat, fp8_format) = RecipeFormat::kE4M3;
  /// The E8M0 rule (TE and cuBLAS: kRceil).
  TORCH_ARG(ScaleRule, scale_rule) = ScaleRule::kRceil;
  /// Weights in 32 x 32 blocks (TE's enable_2d_quantization), one
  /// quantization for both of their products.
  TORCH_ARG(bool, weight_2d) = false;
};

/// TE's NVFP4BlockScaling: E2M1 elements, E4M3 scales per 16 under a float32
/// scale per tensor (block.h's kNvfp4 rule).
struct NVFP4BlockScaling {
  /// Nothing to refuse; here for the recipes' one form.
  void validate() const {}
  /// "nvfp4(16x16 weights, stochastic gradients, hadamard, seed 0)".
  std::string to_string() const;

  /// Weights in 16 x 16 blocks (TE's default), else 1 x 16 along each product's inner dimension.
  TORCH_ARG(bool, weight_2d) = true;
  /// Output gradients rounded stochastically (TE's default), else to nearest.
  TORCH_ARG(bool, stochastic_rounding) = true;
  /// The weight-gradient product's operands (the output gradient and the
  /// input, along the tokens) through hadamard16 and bfloat16 before they
  /// are quantized (TE's random Hadamard transform).
  TORCH_ARG(bool, random_hadamard) = true;
  /// The stochastic rounding's stream; each layer draws its own part of it.
  TORCH_ARG(uint64_t, seed) = 0;
};

/// TE's Float8BlockScaling (DeepSeek-V3's blocks): E4M3 elements; float32
/// scales per 1 x block for inputs and gradients, block x block for weights.
struct Float8BlockScaling {
  /// Throws c10::Error on invalid options (block < 1, negative epsilon).
  void validate() const;
  /// "fp8-block(1x128, 128x128 weights, power-of-2 scales)".
  std::string to_string() const;

  /// Scales rounded down to powers of two (TE's default).
  TORCH_ARG(bool, power_2_scale) = true;
  /// The smallest amax a scale is computed from.
  TORCH_ARG(double, amax_epsilon) = 0.0;
  /// The blocks' side: 1 x block (inputs, gradients), block x block (weights).
  TORCH_ARG(int64_t, block) = 128;
};

}  // namespace fp8
}  // namespace ampx
