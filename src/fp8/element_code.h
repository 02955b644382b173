#pragma once

// The arithmetic every element cast of ampx::fp8 shares: FP8's (cast.cpp)
// and the block-scaled formats' FP6 and FP4 (block/block_elements.cpp,
// block/block_tensor.cpp). A format's codes are contiguous in magnitude, so one
// rounding of a float32 significand to the format's quantum at its exponent
// covers subnormals, normals and the carry into the next binade alike;
// callers add the sign, saturation and their special values (NaN, inf)
// around it.

#include "../kernels/host_device.h"

#include <cmath>
#include <cstdint>

namespace ampx {
namespace fp8 {
namespace detail {

/// v / 2^shift rounded to nearest, ties to even (v < 2^24, so shift >= 25 gives 0).
inline uint32_t shift_round_even(uint32_t v, int shift) {
  if (shift <= 0) return v << -shift;
  if (shift > 31) return 0;
  const uint32_t q = v >> shift;
  const uint32_t rest = v & ((uint32_t(1) << shift) - 1);
  const uint32_t half = uint32_t(1) << (shift - 1);
  return q + ((rest > half || (rest == half && (q & 1))) ? 1 : 0);
}

/// The code (without sign) of the finite float32 magnitude whose bits are
/// `a`, rounded to nearest even in a format of `bias` and `mantissa_bits`;
/// `a` below the format's saturation (the caller's).
inline uint32_t magnitude_code(uint32_t a, int bias, int mantissa_bits) {
  const int biased = static_cast<int>(a >> 23);
  // x = sig * 2^(e - 23), sig with its hidden bit (float32 subnormals: e = -126)
  const uint32_t sig = biased ? ((a & 0x7FFFFF) | 0x800000) : (a & 0x7FFFFF);
  const int e = biased ? biased - 127 : -126;
  // The quantum (spacing of codes) at x: 2^(max(e, emin) - M).
  const int emin = 1 - bias;
  const int quantum_exp = (e > emin ? e : emin) - mantissa_bits;
  // The magnitude's code counted in quanta from 0 is sig rounded to that
  // quantum, plus the codes below x's binade: (e - emin) << M for normals.
  const uint32_t steps = shift_round_even(sig, quantum_exp - (e - 23));
  const uint32_t below = e > emin ? static_cast<uint32_t>(e - emin) << mantissa_bits : 0;
  // Normal: steps counts the hidden bit (1 << M) too; that is one binade's
  // codes, exactly the offset from the subnormals (exponent field 1).
  return below + steps;
}

/// The value of a code without sign (exponent field, then mantissa bits) in
/// a format of `bias` and `mantissa_bits`; no special values.
inline float magnitude_value(uint32_t magnitude, int bias, int mantissa_bits) {
  const int field = static_cast<int>(magnitude >> mantissa_bits);
  const int mantissa = static_cast<int>(magnitude & ((1u << mantissa_bits) - 1));
  return field == 0 ? std::ldexp(static_cast<float>(mantissa), 1 - bias - mantissa_bits)
                    : std::ldexp(static_cast<float>((1 << mantissa_bits) + mantissa),
                                 field - bias - mantissa_bits);
}

/// encode_branchless of the float32 whose sign bit is `sign` (0 or 1) and
/// whose magnitude's bits are `bits`: what the block-scaled casts call with
/// an element's own sign (block/block_math.h).
template <int kMantissa, int kBias, int kBits, bool kNan>
AMPX_HD uint8_t encode_magnitude_branchless(uint32_t sign, uint32_t bits, float max,
                                            uint32_t max_code) {
  constexpr int kShift = 23 - kMantissa;
  constexpr float kMinNormal = 1.0f / static_cast<float>(uint64_t{1} << (kBias - 1));  // 2^(1 - kBias)
  constexpr float kQuantaPerUnit =
      static_cast<float>(uint64_t{1} << (kMantissa + kBias - 1));  // 1 / 2^(1 - kBias - kMantissa)
  constexpr float kRound = 12582912.0f;                            // 1.5 x 2^23
  const float a = ampx::detail::bits_float(bits);
  const uint32_t rounded = bits + ((1u << (kShift - 1)) - 1) + ((bits >> kShift) & 1u);
  const uint32_t normal = (rounded >> kShift) - (static_cast<uint32_t>(127 - kBias) << kMantissa);
  const uint32_t below = static_cast<uint32_t>(static_cast<int32_t>((a * kQuantaPerUnit + kRound) - kRound));
  uint32_t code = a < kMinNormal ? below : normal;
  code = a >= max ? max_code : code;
  code = bits > 0x7F800000u ? (kNan ? 0x7Fu : 0u) : code;
  return static_cast<uint8_t>((sign << (kBits - 1)) | code);
}

/// The code of float32 `y` in a format of `kMantissa` mantissa bits, `kBias`
/// and `kBits` bits (sign included), whose largest magnitude `max` has the
/// code `max_code`: saturated, rounded to nearest even, NaN to 0x7F with the
/// sign (kNan: the FP8 formats) or to a signed zero (FP6, FP4: no NaN).
/// The same codes as magnitude_code with the callers' special cases, written
/// without branches so that loops over elements vectorise: normals round the
/// float32 significand in place (a carry moves to the next binade), values
/// below the smallest normal count its quanta with the 1.5 x 2^23 addition.
/// The CUDA casts (fp8/cuda/, fp8/block/cuda/) run it too (fp8_math.h,
/// block/block_math.h).
template <int kMantissa, int kBias, int kBits, bool kNan>
AMPX_HD uint8_t encode_branchless(float y, float max, uint32_t max_code) {
  const uint32_t u = ampx::detail::float_bits(y);
  return encode_magnitude_branchless<kMantissa, kBias, kBits, kNan>(u >> 31, u & 0x7FFFFFFFu, max,
                                                                    max_code);
}

}  // namespace detail
}  // namespace fp8
}  // namespace ampx
