#pragma once

/// \file
/// The formats a precision plan gives a Linear layer (ampx/precision_plan.h):
/// their names, recipes, scale rules, element widths and the order the plan
/// watch widens them along.

#include "ampx/fp8/scaling.h"

#include <cstdint>
#include <string>
#include <vector>

namespace ampx {
namespace plan {

/// A Linear layer's format in a plan. Named as ampx-train's modes name them.
enum class LayerFormat {
  /// "fp32": float32 operands and products, outside autocast (a wide product)
  kFloat32,
  /// "fp16": float16 operands and products (float32 accumulation), the output
  /// unscaled in float32 and the bias added there; the weight scaled by a
  /// power of two to a largest value in (0.5, 1], and before each product
  /// the other operand (the input forward, the output gradient backward) by
  /// the largest power of two that keeps it and the product's worst case
  /// within 2^15: float16's loss scaling done per layer, product and step
  /// (no step skipped), for the activations too
  kFloat16,
  kBFloat16,  ///< "bf16": the layer runs under bf16 autocast (not converted)
  kFp8,       ///< "fp8": FP8 tensorwise current scaling (HYBRID: E4M3 forward, E5M2 gradients)
  kMxfp8,     ///< "mxfp8": MXFP8BlockScaling (E4M3, E8M0 per 1 x 32)
  kNvfp4,     ///< "nvfp4": NVFP4BlockScaling (E2M1, E4M3 per 16, fp32 per tensor)
  kFp8Block,  ///< "fp8-block": Float8BlockScaling (1 x 128, 128 x 128 weights)
};

/// "fp32", "fp16", "bf16", "fp8", "mxfp8", "nvfp4", "fp8-block".
std::string to_string(LayerFormat format);
/// The format named `name` (as to_string writes it); c10::Error naming
/// `what` and the value otherwise.
LayerFormat parse_layer_format(const std::string& name, const std::string& what = "format");
/// Every format, widest first: fp32, fp16, bf16, fp8-block, fp8, mxfp8, nvfp4.
std::vector<LayerFormat> all_layer_formats();
/// The fp8::Recipe a converted layer of `format` runs (NVFP4's stochastic
/// rounding drawn from `seed`); c10::Error for bf16 (autocast runs it) and
/// fp32 and fp16 (wide products).
fp8::Recipe recipe_of(LayerFormat format, uint64_t seed = 0);
/// The scale rule a layer of `format` is cast with, as its recipe names it
/// ("current(hybrid)", "nvfp4(16x16 weights, ...)"); bf16: "autocast (no scale)";
/// fp32 and fp16 say how their products run.
std::string scale_rule_of(LayerFormat format, uint64_t seed = 0);

/// The bits of one element of `format`: 32 (fp32), 16 (fp16, bf16), 8
/// (fp8, fp8-block, mxfp8), 4 (nvfp4). What a Floor compares.
int element_bits(LayerFormat format);

/// The next format wider than `format` that `target`'s cost model runs
/// (h100 and b200: those cost_model_for names; any other target: every
/// format), along nvfp4 -> mxfp8 -> fp8 -> fp8-block -> bf16; fp16 moves to
/// fp32 (the range it lacks); bf16 and fp32 stay.
LayerFormat wider_format(LayerFormat format, const std::string& target);

}  // namespace plan
}  // namespace ampx
