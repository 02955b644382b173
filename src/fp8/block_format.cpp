// The block-scaled formats' scale rules (ampx/fp8/block.h): E8M0 bytes by
// OCP's floor, torchao's ceil and even and NVIDIA's round-up, NVFP4's
// tensor scale, and BlockFormat's named formats and checks.

#include "ampx/fp8/block.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <limits>

namespace ampx {
namespace fp8 {
namespace {

constexpr int kScaleBias = 127;
constexpr uint8_t kScaleNan = 0xFF;

// The biased exponent field of a float32 (0 for zeros and subnormals, 255
// for inf and NaN), and whether its mantissa is nonzero.
int exponent_field(float v) {
  return static_cast<int>((std::bit_cast<uint32_t>(v) >> 23) & 0xFF);
}
bool has_mantissa(float v) {
  return (std::bit_cast<uint32_t>(v) & 0x7FFFFF) != 0;
}

uint8_t biased(int exponent) {
  return static_cast<uint8_t>(std::clamp(exponent, -kScaleBias, kScaleBias + 1) + kScaleBias);
}

}  // namespace

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
  const ElementLimits& l = limits(format);
  if (std::isnan(amax)) return kScaleNan;
  if (rule == ScaleRule::kRceil) {
    if (std::isinf(amax)) return 0xFE;
    const float descale = amax / l.max;  // float32, as torchao and TE compute it
    if (descale == 0.0f) return 0;
    // The exponent of the next power of two at or above descale.
    int e = 0;
    const float m = std::frexp(descale, &e);  // descale = m 2^e, m in [0.5, 1)
    const int up = m == 0.5f ? e - 1 : e;
    return static_cast<uint8_t>(std::clamp(up, -kScaleBias, kScaleBias) + kScaleBias);
  }
  float a = amax;
  if (rule == ScaleRule::kEven && std::isfinite(a)) {
    // amax rounded to the element's mantissa bits (half up, on the bits), so
    // a block whose amax rounds to the next binade takes that binade.
    const uint32_t half = uint32_t{1} << (23 - l.mantissa_bits - 1);
    a = std::bit_cast<float>((std::bit_cast<uint32_t>(a) + half) & 0xFF800000u);
  }
  int exponent = exponent_field(a) - kScaleBias;  // zeros and subnormals: -127; inf: 128
  if (rule == ScaleRule::kCeil && has_mantissa(a)) exponent += 1;
  return biased(exponent - l.max_pow2);
}

float scale_value(uint8_t byte) {
  if (byte == kScaleNan) return std::numeric_limits<float>::quiet_NaN();
  return byte == 0 ? std::bit_cast<float>(uint32_t{0x00400000})
                   : std::bit_cast<float>(static_cast<uint32_t>(byte) << 23);
}

float nvfp4_encode_scale(float global_amax) {
  // TE's compute_global_encode_scaling_factor_FP4: 448 * 6 / amax, at most
  // FLT_MAX, 1 where that is 0 (a zero tensor) or the amax is 0.
  const float s = std::min(448.0f * 6.0f / global_amax, FLT_MAX);
  return global_amax == 0.0f || s == 0.0f ? 1.0f : s;
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
