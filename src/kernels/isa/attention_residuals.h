#pragma once

// The attention forward's residual codes (AttentionProblem::residual): the
// rounding error of each 16-bit output element as an int16 code, so that
// backward sees the float32 output at 2 bytes per element. A part of
// attention_span.cpp's translation unit (see there), included only by it.
//
// A row of float32 results `exact` rounded to the 16-bit `rounded` (widened
// back) has as codes each difference in units of 2^-15 of the rounded value's
// spacing in its format (at most half a spacing, so |code| <= 16384), which
// makes rounded + code * spacing * 2^-15 within 2^-16 spacings of exact: for
// bf16 about one float32 ulp, for fp16 finer. The unit, 2^15 / spacing, is a
// power of two made from the rounded value's exponent bits (spacing at least
// fp16's 2^-24; for bf16 values below 2^-105 the unit saturates and the
// residual, under 2^-113, loses precision). A non-finite value gets a saturated
// code and stays non-finite. Branch-free, so that the loops vectorize.

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

// 2^15 / spacing of `rounded` in its format (see above).
inline float unit_of(float rounded, int32_t mantissa_bits, int32_t min_spacing_exponent) {
  uint32_t bits;
  std::memcpy(&bits, &rounded, sizeof bits);
  const int32_t exponent = static_cast<int32_t>((bits >> 23) & 0xffu);  // biased
  const int32_t spacing = std::max(exponent - mantissa_bits, min_spacing_exponent);
  const int32_t unit = std::min(std::max(127 + 15 + 127 - spacing, 1), 254);  // 2^15 / spacing
  const uint32_t unit_bits = static_cast<uint32_t>(unit) << 23;
  float f;
  std::memcpy(&f, &unit_bits, sizeof f);
  return f;
}

int32_t mantissa_bits_of(c10::ScalarType dtype) {
  return dtype == c10::kBFloat16 ? 7 : 10;
}
int32_t min_spacing_exponent_of(c10::ScalarType dtype) {  // biased: bf16 none, fp16 2^-24
  return dtype == c10::kBFloat16 ? 0 : 127 - 24;
}

// codes[i]: exact[i] - rounded[i] in units of 2^-15 of rounded[i]'s spacing.
void encode_residuals(const float* exact, const float* rounded, int16_t* codes, int64_t n,
                      c10::ScalarType dtype) {
  const int32_t mantissa = mantissa_bits_of(dtype), floor = min_spacing_exponent_of(dtype);
  for (int64_t i = 0; i < n; ++i) {
    const float units = (exact[i] - rounded[i]) * unit_of(rounded[i], mantissa, floor);
    codes[i] = static_cast<int16_t>(std::max(-32767.f, std::min(32767.f, std::nearbyint(units))));
  }
}

// rounded[i] += codes[i] / unit: the float32 results back.
void decode_residuals(float* rounded, const int16_t* codes, int64_t n, c10::ScalarType dtype) {
  const int32_t mantissa = mantissa_bits_of(dtype), floor = min_spacing_exponent_of(dtype);
  for (int64_t i = 0; i < n; ++i) {
    rounded[i] += static_cast<float>(codes[i]) / unit_of(rounded[i], mantissa, floor);
  }
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
