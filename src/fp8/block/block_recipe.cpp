// The block-scaled recipes' options (ampx/fp8/block_recipe.h).

#include "ampx/fp8/block_recipe.h"
#include "block_internal.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>

namespace ampx {
namespace fp8 {

const char* detail::recipe_format_name(RecipeFormat format) {
  switch (format) {
    case RecipeFormat::kE4M3: return "e4m3";
    case RecipeFormat::kHybrid: return "hybrid";
    case RecipeFormat::kE5M2: return "e5m2";
  }
  return "?";
}

void MXFP8BlockScaling::validate() const {
  TORCH_CHECK_VALUE(fp8_format_ != RecipeFormat::kE5M2,
                    "ampx::fp8::MXFP8BlockScaling: fp8_format E5M2 in both passes is refused, as "
                    "Transformer Engine refuses it (E4M3 or HYBRID)");
  TORCH_CHECK_VALUE(is_e8m0(scale_rule_), "ampx::fp8::MXFP8BlockScaling: scale_rule ",
                    fp8::to_string(scale_rule_),
                    " has no E8M0 scale (floor, ceil, even or rceil)");
}

std::string MXFP8BlockScaling::to_string() const {
  std::ostringstream s;
  s << "mxfp8(" << detail::recipe_format_name(fp8_format_) << ", " << fp8::to_string(scale_rule_)
    << (weight_2d_ ? ", 32x32 weights" : "") << ")";
  return s.str();
}

std::string NVFP4BlockScaling::to_string() const {
  std::ostringstream s;
  s << "nvfp4(" << (weight_2d_ ? "16x16" : "1x16") << " weights, "
    << (stochastic_rounding_ ? "stochastic" : "nearest") << " gradients"
    << (random_hadamard_ ? ", hadamard" : "") << ", seed " << seed_ << ")";
  return s.str();
}

void Float8BlockScaling::validate() const {
  TORCH_CHECK_VALUE(block_ >= 1, "ampx::fp8::Float8BlockScaling: block must be >= 1, got ",
                    block_);
  TORCH_CHECK_VALUE(amax_epsilon_ >= 0.0 && std::isfinite(amax_epsilon_),
                    "ampx::fp8::Float8BlockScaling: amax_epsilon must be finite and >= 0, got ",
                    amax_epsilon_);
}

std::string Float8BlockScaling::to_string() const {
  std::ostringstream s;
  s << "fp8-block(1x" << block_ << ", " << block_ << "x" << block_ << " weights, "
    << (power_2_scale_ ? "power-of-2" : "float32") << " scales";
  if (amax_epsilon_ > 0) s << ", amax_epsilon " << amax_epsilon_;
  s << ")";
  return s.str();
}

}  // namespace fp8
}  // namespace ampx
