#pragma once

// The one table of floating-point formats: every exact constant of float32,
// float16, bfloat16, the two FP8 formats and the FP6/FP4 elements, written once and derived from
// the bit layout where it follows from it, for ampx::debug's limits
// (debug/formats.cpp) and ampx::fp8's (fp8/cast.cpp). After CUTLASS's
// float8.h: the constants once, the precision in the type that carries them.
//
//   detail::kE4M3.max;              // 448
//   detail::kE4M3.min_normal();     // 2^-6
//   detail::kE4M3.min_subnormal();  // 2^-9
//   detail::kE4M3.overflow_from();  // 464: 448 + half a step (ties to even)

#include <bit>
#include <cstdint>
#include <limits>

namespace ampx {
namespace detail {

/// 2^e as a float, exactly, at compile time (-149 <= e <= 127): built from
/// its bits, a normal's exponent field or a subnormal's one mantissa bit.
constexpr float pow2f(int e) {
  return e >= -126 ? std::bit_cast<float>(static_cast<uint32_t>(e + 127) << 23)
                   : std::bit_cast<float>(uint32_t(1) << (e + 149));
}

/// The layout of a binary floating-point format and what follows from it.
struct FloatFormatSpec {
  const char* torch_name;  ///< "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"
  int exponent_bits;
  int mantissa_bits;  ///< explicit mantissa bits
  int bias;
  /// Largest finite value. IEEE-like formats: all-ones mantissa below the
  /// inf exponent; e4m3fn: 1.110 x 2^8 (1.111 at the top exponent is NaN).
  float max;
  /// Whether the format has inf (all but e4m3fn). Then max's mantissa is all
  /// ones (odd), so the halfway point above it rounds away, to inf.
  bool has_inf;

  /// Smallest positive normal: 2^(1 - bias).
  constexpr float min_normal() const { return pow2f(1 - bias); }
  /// Smallest positive subnormal: min_normal / 2^mantissa_bits.
  constexpr float min_subnormal() const { return pow2f(1 - bias - mantissa_bits); }
  /// The exponent of max (unbiased).
  constexpr int max_exponent() const {
    return static_cast<int>((std::bit_cast<uint32_t>(max) >> 23) & 0xFF) - 127;
  }
  /// max plus half its step: |x| beyond it does not round to max.
  constexpr float overflow_from() const { return max + pow2f(max_exponent() - mantissa_bits - 1); }
  /// The bit pattern of +max: its biased exponent, then its mantissa bits.
  constexpr uint32_t max_bits() const {
    // max's float32 mantissa, cut to this format's mantissa_bits (exact: max has no more).
    const uint32_t fraction = (std::bit_cast<uint32_t>(max) & 0x7FFFFF) >> (23 - mantissa_bits);
    return (static_cast<uint32_t>(max_exponent() + bias) << mantissa_bits) | fraction;
  }
  /// Whether |x| == overflow_from itself overflows: ties to even leave it at
  /// max only when max's mantissa is even (e4m3fn's 0b110).
  constexpr bool overflow_inclusive() const { return has_inf; }
};

inline constexpr FloatFormatSpec kFloat32{"float32", 8, 23, 127, std::numeric_limits<float>::max(),
                                          true};
inline constexpr FloatFormatSpec kFloat16{"float16", 5, 10, 15, 65504.0f, true};
inline constexpr FloatFormatSpec kBFloat16{"bfloat16", 8, 7, 127, 255.0f * pow2f(120), true};
inline constexpr FloatFormatSpec kE4M3{"float8_e4m3fn", 4, 3, 7, 448.0f, false};
inline constexpr FloatFormatSpec kE5M2{"float8_e5m2", 5, 2, 15, 57344.0f, true};
// The block-scaled formats' FP6 and FP4 elements (OCP MX 1.0): finite only,
// no NaN, max at the all-ones code.
inline constexpr FloatFormatSpec kE3M2{"float6_e3m2fn", 3, 2, 3, 28.0f, false};
inline constexpr FloatFormatSpec kE2M3{"float6_e2m3fn", 2, 3, 1, 7.5f, false};
inline constexpr FloatFormatSpec kE2M1{"float4_e2m1fn", 2, 1, 1, 6.0f, false};

static_assert(kFloat16.overflow_from() == 65520.0f, "fp16: 65504 + 16 rounds to inf");
static_assert(kBFloat16.overflow_from() == 511.0f * pow2f(119), "bf16: max + 2^119");
static_assert(kE4M3.overflow_from() == 464.0f, "e4m3fn: 448 + 16 stays 448 (ties to even)");
static_assert(kE5M2.overflow_from() == 61440.0f, "e5m2: 57344 + 4096 rounds to inf");
static_assert(kE4M3.max_bits() == 0x7E && kE5M2.max_bits() == 0x7B, "the codes of +max");
static_assert(kE3M2.max_bits() == 0x1F && kE2M3.max_bits() == 0x1F && kE2M1.max_bits() == 0x7,
              "FP6's and FP4's +max: every magnitude bit set");
static_assert(kE4M3.max_exponent() == 8 && kE5M2.max_exponent() == 15 &&
                  kE3M2.max_exponent() == 4 && kE2M3.max_exponent() == 2 &&
                  kE2M1.max_exponent() == 2,
              "emax_elem of OCP MX 1.0");
static_assert(kFloat16.max_bits() == 0x7BFF, "fp16's +max");
static_assert(kE4M3.min_normal() == 0.015625f && kE4M3.min_subnormal() == 0.001953125f,
              "e4m3: 2^-6 and 2^-9");
static_assert(kE5M2.min_normal() == 0.00006103515625f &&
                  kE5M2.min_subnormal() == 0.0000152587890625f,
              "e5m2: 2^-14 and 2^-16");

}  // namespace detail
}  // namespace ampx
