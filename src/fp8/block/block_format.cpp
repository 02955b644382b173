// The block-scaled formats' scale rules (ampx/fp8/block.h): E8M0 bytes by
// OCP's floor, torchao's ceil and even and NVIDIA's round-up, NVFP4's
// tensor scale, and BlockFormat's named formats and checks.

#include "ampx/fp8/block.h"

#include "block_math.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace ampx {
namespace fp8 {

std::string to_string(ScaleRule rule) {
  switch (rule) {
    case ScaleRule::kFloor:
      return "floor";
    case ScaleRule::kCeil:
      return "ceil";
    case ScaleRule::kEven:
      return "even";
    case ScaleRule::kRceil:
      return "rceil";
    case ScaleRule::kNvfp4:
      return "nvfp4";
    case ScaleRule::kFloat32:
      return "float32";
    case ScaleRule::kFloat32Pow2:
      return "float32-pow2";
  }
  return "?";
}

bool is_e8m0(ScaleRule rule) {
  return rule == ScaleRule::kFloor || rule == ScaleRule::kCeil || rule == ScaleRule::kEven ||
         rule == ScaleRule::kRceil;
}

uint8_t scale_byte(float amax, ElementFormat format, ScaleRule rule) {
  TORCH_CHECK_VALUE(is_e8m0(rule), "ampx::fp8::scale_byte: rule ", to_string(rule),
                    " has no E8M0 scale (floor, ceil, even or rceil)");
  const block_math::ScaleParams p = block_math::scale_params(BlockFormat(format, rule));
  return block_math::e8m0_byte(amax, p);
}

float scale_value(uint8_t byte) {
  return block_math::e8m0_value(byte);
}

float nvfp4_encode_scale(float global_amax) {
  return block_math::nvfp4_encode_scale(global_amax);
}

BlockFormat BlockFormat::mxfp8(ElementFormat element, ScaleRule rule) {
  return BlockFormat(element, rule);
}
BlockFormat BlockFormat::mxfp6(ElementFormat element, ScaleRule rule) {
  return BlockFormat(element, rule);
}
BlockFormat BlockFormat::mxfp4(ScaleRule rule) {
  return BlockFormat(ElementFormat::kE2M1, rule);
}
BlockFormat BlockFormat::nvfp4() {
  return BlockFormat(ElementFormat::kE2M1, ScaleRule::kNvfp4).block_cols(16);
}
BlockFormat BlockFormat::fp8_blockwise() {
  return BlockFormat(ElementFormat::kE4M3, ScaleRule::kFloat32Pow2).block_cols(128);
}

void BlockFormat::validate() const {
  TORCH_CHECK_VALUE(block_rows_ >= 1 && block_cols_ >= 1,
                    "ampx::fp8::BlockFormat: block_rows and block_cols must be >= 1, got ",
                    block_rows_, " x ", block_cols_);
  TORCH_CHECK_VALUE(rule_ != ScaleRule::kNvfp4 || element_ == ElementFormat::kE2M1,
                    "ampx::fp8::BlockFormat: the nvfp4 rule takes e2m1 elements, got ",
                    fp8::to_string(element_));
  const bool fp32_scales = rule_ == ScaleRule::kFloat32 || rule_ == ScaleRule::kFloat32Pow2;
  TORCH_CHECK_VALUE(
      !fp32_scales || element_ == ElementFormat::kE4M3 || element_ == ElementFormat::kE5M2,
      "ampx::fp8::BlockFormat: float32 block scales take e4m3 or e5m2 elements, got ",
      fp8::to_string(element_));
  TORCH_CHECK_VALUE(amax_epsilon_ >= 0.0 && std::isfinite(amax_epsilon_),
                    "ampx::fp8::BlockFormat: amax_epsilon must be finite and >= 0, got ",
                    amax_epsilon_);
}

std::string BlockFormat::to_string() const {
  return fp8::to_string(element_) + "/" + fp8::to_string(rule_) + "/" +
         std::to_string(block_rows_) + "x" + std::to_string(block_cols_);
}

}  // namespace fp8
}  // namespace ampx
