#pragma once

// The arithmetic of the block-scaled formats (ampx/fp8/block.h), written once
// for both devices: BlockTensor's CPU loops (block_tensor.cpp, block_format.cpp,
// block_elements.cpp) and its CUDA kernels (cuda/block_kernels.cu) call these
// functions, so the CPU tests check what the GPU computes, as fp8_math.h
// does for the tensorwise casts. The .cu files are compiled without FMA
// contraction (--fmad=false): each product and quotient rounds once on both.
//
//   e8m0_byte(amax, params)        a block's E8M0 byte by floor, ceil, even, rceil
//   block_scale(amax, params, ...) any rule's scale: what is stored, what the
//                                  codes decode by, what the elements are
//                                  multiplied by before the cast
//   nvfp4_encode_scale(amax)       NVFP4's S_enc, from the tensor's amax
//   ElementCode<...>               an element's code, nearest even or
//                                  stochastic (element_code.h's arithmetic);
//                                  .scaled(x, factor[, random]): of x times
//                                  its block's factor, with x's sign
//   stream_bits(key, index)        the stochastic-rounding stream
//   hadamard16_tile(v, inverse)    NVFP4's 16-point transform of 16 floats
// (FP4 packing is ATen's bitwise ops, the same on both devices: block.h.)

#include "ampx/fp8/block.h"

#include "../../kernels/host_device.h"
#include "../element_code.h"
#include "../fp8_math.h"

#include <cfloat>
#include <cstdint>

namespace ampx {
namespace fp8 {
namespace block_math {

/// The one NaN the block arithmetic writes (positive, quiet): a NaN amax's
/// scale on both devices, whatever payload the input's NaN had.
AMPX_HD float quiet_nan() {
  return ampx::detail::bits_float(0x7FC00000u);
}

// ---- the stochastic-rounding stream ----------------------------------------------

/// splitmix64's finaliser.
AMPX_HD uint64_t mix_bits64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// The key of the stream of `seed`.
AMPX_HD uint64_t stream_key(uint64_t seed) {
  return mix_bits64(seed + 0x9E3779B97F4A7C15ull);
}

/// The stream's 32 random bits for element `index` (splitmix64's finaliser,
/// twice): counter-based, the same on any number of threads and devices.
AMPX_HD uint32_t stream_bits(uint64_t key, uint64_t index) {
  return static_cast<uint32_t>(mix_bits64(key + index) >> 32);
}

// ---- elements ------------------------------------------------------------------------

/// The magnitude of code `code` (sign bit clear, below the format's NaN and
/// inf codes) of a format of kMantissa bits and kBias: normals are the
/// code's bits moved into a float32's exponent and mantissa, subnormals
/// whole quanta of 2^(1 - kBias - kMantissa); both exact.
template <int kMantissa, int kBias>
AMPX_HD float magnitude_of(uint32_t code) {
  // 2^(1 - kBias - kMantissa)
  constexpr float kQuantum = 1.0f / static_cast<float>(uint64_t{1} << (kMantissa + kBias - 1));
  const float normal = ampx::detail::bits_float((code << (23 - kMantissa)) +
                                                (static_cast<uint32_t>(127 - kBias) << 23));
  const float subnormal = static_cast<float>(code & ((1u << kMantissa) - 1)) * kQuantum;
  return (code >> kMantissa) == 0 ? subnormal : normal;
}

/// The element codes of a format of kMantissa mantissa bits, kBias and kBits
/// bits (sign included), whose largest magnitude `max` has the code
/// `max_code`; kNan: a NaN has a NaN code (FP8), not a signed zero (FP6,
/// FP4). The calls on (x, factor) cast x times its block's factor with x's
/// own sign (the product's sign but where the product is NaN: a NaN the
/// product makes has one sign on the x86 CPU and another on the GPU).
template <int kMantissa, int kBias, int kBits, bool kNan>
struct ElementCode {
  float max;          // the largest magnitude
  uint32_t max_code;  // its code

  /// y's code, rounded to nearest even (element_code.h's encode_branchless).
  AMPX_HD uint8_t operator()(float y) const {
    return fp8::detail::encode_branchless<kMantissa, kBias, kBits, kNan>(y, max, max_code);
  }

  /// y's code rounded stochastically by `random`, uniform in [0, 2^32).
  AMPX_HD uint8_t operator()(float y, uint32_t random) const {
    const uint32_t u = ampx::detail::float_bits(y);
    return stochastic(u >> 31, u & 0x7FFFFFFFu, random);
  }

  /// The code of x * factor, rounded to nearest even, with x's sign.
  AMPX_HD uint8_t scaled(float x, float factor) const {
    return fp8::detail::encode_magnitude_branchless<kMantissa, kBias, kBits, kNan>(
        ampx::detail::float_bits(x) >> 31, ampx::detail::float_bits(x * factor) & 0x7FFFFFFFu, max,
        max_code);
  }

  /// The code of x * factor, rounded stochastically, with x's sign.
  AMPX_HD uint8_t scaled(float x, float factor, uint32_t random) const {
    return stochastic(ampx::detail::float_bits(x) >> 31,
                      ampx::detail::float_bits(x * factor) & 0x7FFFFFFFu, random);
  }

  /// The code of sign `sign` (0 or 1) and magnitude bits `bits`, rounded
  /// stochastically: to the code at or below it or the next one up, up with
  /// probability (|y| - lower) / (upper - lower) at a resolution of 2^-24
  /// (the top 24 bits of `random` against it); saturated to +-max; NaN as
  /// rounding to nearest. The distance to the next code is the quantum of
  /// a's binade (a power of two: the quotient is a product, exact).
  AMPX_HD uint8_t stochastic(uint32_t sign, uint32_t bits, uint32_t random) const {
    constexpr int kShift = 23 - kMantissa;
    constexpr float kMinNormal = 1.0f / static_cast<float>(uint64_t{1} << (kBias - 1));
    constexpr float kQuantaPerUnit = static_cast<float>(uint64_t{1} << (kMantissa + kBias - 1));
    const float a = ampx::detail::bits_float(bits);
    // The code at or below a: the significand truncated, or whole quanta.
    const uint32_t normal = (bits >> kShift) - (static_cast<uint32_t>(127 - kBias) << kMantissa);
    const uint32_t below = static_cast<uint32_t>(static_cast<int32_t>(a * kQuantaPerUnit));
    uint32_t code = a < kMinNormal ? below : normal;
    const bool top = !(a < max);  // saturated, inf or NaN: no code above
    code = top ? max_code : code;
    // a in quanta of its binade (2^(e - kMantissa) in a normal binade e, the
    // subnormals' below the smallest normal): exact, a power of two's
    // product; its fraction is the distance from the code below over the
    // spacing to the next, exact too.
    constexpr uint32_t kMinField = 128 - kBias;  // the smallest normal's float32 exponent field
    const uint32_t field = bits >> 23 > kMinField ? bits >> 23 : kMinField;
    const float inv_quantum = ampx::detail::bits_float((254u + kMantissa - field) << 23);
    const float quanta = top ? 0.0f : a * inv_quantum;  // < 2^(kMantissa + 1) below max
    const float p = quanta - static_cast<float>(static_cast<int32_t>(quanta));  // in [0, 1)
    code += !top && static_cast<float>(random >> 8) < p * 16777216.0f ? 1u : 0u;
    code = bits > 0x7F800000u ? (kNan ? 0x7Fu : 0u) : code;
    return static_cast<uint8_t>((sign << (kBits - 1)) | code);
  }
};

using E4M3Code = ElementCode<3, 7, 8, true>;
using E5M2Code = ElementCode<2, 15, 8, true>;
using E3M2Code = ElementCode<2, 3, 6, false>;
using E2M3Code = ElementCode<3, 1, 6, false>;
using E2M1Code = ElementCode<1, 1, 4, false>;

/// The value of an E4M3 byte (NVFP4's block scales): cast.h's decode, NaN
/// (quiet_nan with the sign) for 0x7F and 0xFF.
AMPX_HD float e4m3_value(uint8_t byte) {
  const uint32_t magnitude = byte & 0x7Fu;
  const float m = magnitude == 0x7Fu ? quiet_nan() : magnitude_of<3, 7>(magnitude);
  return byte & 0x80u ? -m : m;
}

// ---- scales ----------------------------------------------------------------------------

constexpr int kScaleBias = 127;
constexpr uint8_t kScaleNan = 0xFF;

/// What a block's scale follows from, besides its amax: the format's rule and
/// its element's constants (a plain struct both devices take by value).
struct ScaleParams {
  ScaleRule rule;
  float max;           // the element's largest magnitude
  int max_pow2;        // emax_elem
  int mantissa_bits;   // the element's
  float amax_epsilon;  // kFloat32 rules
};

/// The parameters of `format`'s scales.
inline ScaleParams scale_params(const BlockFormat& format) {
  const ElementLimits& l = limits(format.element());
  return {format.rule(), l.max, l.max_pow2, l.mantissa_bits,
          static_cast<float>(format.amax_epsilon())};
}

/// The E8M0 byte of a block whose amax is `amax` by an E8M0 rule (the table
/// of ampx/fp8/block.h): exponent plus 127, within [0, 254], 0xFF for NaN.
AMPX_HD uint8_t e8m0_byte(float amax, const ScaleParams& p) {
  const uint32_t bits = ampx::detail::float_bits(amax) & 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return kScaleNan;
  if (p.rule == ScaleRule::kRceil) {
    if (bits == 0x7F800000u) return 0xFE;
    // descale = amax / max_elem (one float32 division, as torchao and TE
    // compute it), raised to the next power of two unless it is one.
    const uint32_t d = ampx::detail::float_bits(amax / p.max) & 0x7FFFFFFFu;
    if (d <= 0x00400000u) return 0;  // at or below 2^-127 (zero included)
    if (d < 0x00800000u) return 1;   // a subnormal above 2^-127: up to 2^-126
    const int up = static_cast<int>(d >> 23) - kScaleBias + ((d & 0x7FFFFFu) != 0 ? 1 : 0);
    return static_cast<uint8_t>((up > kScaleBias ? kScaleBias : up) + kScaleBias);
  }
  uint32_t a = bits;
  if (p.rule == ScaleRule::kEven && a < 0x7F800000u) {
    // amax rounded to the element's mantissa bits (half up, on the bits), so
    // a block whose amax rounds to the next binade takes that binade.
    const uint32_t half = uint32_t{1} << (23 - p.mantissa_bits - 1);
    a = (a + half) & 0xFF800000u;
  }
  // zeros and subnormals: -127; inf: 128
  int exponent = static_cast<int>(a >> 23) - kScaleBias;
  if (p.rule == ScaleRule::kCeil && (a & 0x7FFFFFu) != 0) exponent += 1;
  exponent -= p.max_pow2;
  exponent = exponent < -kScaleBias ? -kScaleBias : exponent;
  exponent = exponent > kScaleBias + 1 ? kScaleBias + 1 : exponent;
  return static_cast<uint8_t>(exponent + kScaleBias);
}

/// 2^(byte - 127) as a float32 (byte 0: 2^-127, a subnormal), NaN for 0xFF.
AMPX_HD float e8m0_value(uint8_t byte) {
  if (byte == kScaleNan) return quiet_nan();
  return byte == 0 ? ampx::detail::bits_float(0x00400000u)
                   : ampx::detail::bits_float(static_cast<uint32_t>(byte) << 23);
}

/// NVFP4's tensor-level encoding scale S_enc of a tensor whose amax is
/// `global_amax` (TE's compute_global_encode_scaling_factor_FP4): 448 * 6 /
/// amax, at most FLT_MAX, 1 where that is 0 or the amax is; NaN for a NaN
/// amax.
AMPX_HD float nvfp4_encode_scale(float global_amax) {
  const float q = 448.0f * 6.0f / global_amax;
  const float s = FLT_MAX < q ? FLT_MAX : q;
  if (s != s) return quiet_nan();
  return global_amax == 0.0f || s == 0.0f ? 1.0f : s;
}

/// A block's scale: what the codes are multiplied by, what the elements
/// are multiplied by before the cast, and what is stored (E8M0 or E4M3
/// byte, or the float32 decoding scale).
struct BlockScale {
  float decode;
  float encode;
  uint8_t byte;        // E8M0 rules and kNvfp4
  float stored_float;  // kFloat32 rules: decode
};

/// The scale of a block whose amax is `amax` (NaN when an element is),
/// under `p`; s_enc is NVFP4's tensor scale (nvfp4_encode_scale).
AMPX_HD BlockScale block_scale(float amax, const ScaleParams& p, float s_enc) {
  const bool nan = (ampx::detail::float_bits(amax) & 0x7FFFFFFFu) > 0x7F800000u;
  switch (p.rule) {
    case ScaleRule::kNvfp4: {
      // One rounding of block_amax * (S_enc / 6) to E4M3; no lower clamp.
      const uint8_t byte = math::encode<math::Format::kE4M3>(amax * (s_enc * (1.0f / 6.0f)));
      const float scale = e4m3_value(byte);
      const float inv = 1.0f / (scale * (1.0f / s_enc));
      const float encode = inv != inv ? quiet_nan() : FLT_MAX < inv ? FLT_MAX : inv;
      return {scale, encode, byte, 0.0f};
    }
    case ScaleRule::kFloat32:
    case ScaleRule::kFloat32Pow2: {
      if (nan) return {quiet_nan(), quiet_nan(), 0, quiet_nan()};
      const float a = amax < p.amax_epsilon ? p.amax_epsilon : amax;
      float scale = a == 0.0f ? 1.0f : p.max / a;
      if (ampx::detail::float_bits(scale) == 0x7F800000u) scale = FLT_MAX;
      // Down to a power of two: the exponent bits alone (scale >= 448 /
      // FLT_MAX here, a normal).
      if (p.rule == ScaleRule::kFloat32Pow2 && scale > 0.0f) {
        scale = ampx::detail::bits_float(ampx::detail::float_bits(scale) & 0xFF800000u);
      }
      const float inv = 1.0f / scale;
      return {inv, scale, 0, inv};
    }
    default: {
      const uint8_t byte = e8m0_byte(amax, p);
      // x / 2^s is the same float32 as x * 2^-s (torchao's RCEIL and TE
      // multiply by the reciprocal, its other rules divide): the reciprocal
      // of a power of two from 2^-127 (a subnormal, never flushed) to 2^127
      // is exact.
      const float scale = e8m0_value(byte);
      return {scale, 1.0f / scale, byte, 0.0f};
    }
  }
}

/// The decoding scale of stored block scale `byte` (E8M0 rules, kNvfp4).
AMPX_HD float scale_of_byte(uint8_t byte, ScaleRule rule) {
  return rule == ScaleRule::kNvfp4 ? e4m3_value(byte) : e8m0_value(byte);
}

/// The amax of a block from the running max of its elements' |x| and
/// whether one was NaN: quiet_nan() then.
AMPX_HD float block_amax(float max_abs, bool nan) {
  return nan ? quiet_nan() : max_abs;
}

// ---- NVFP4's Hadamard transform ----------------------------------------------------

/// TE's sign vector S (get_wgrad_sign_vector, torchao's DEFAULT_SIGN_VECTOR:
/// 1 1 1 -1 1 -1 -1 -1 -1 -1 -1 1 -1 1 -1 -1): bit i set where S_i is -1.
constexpr uint32_t kHadamardNegative = 0xD7E8u;

/// S_i / 4, exact.
AMPX_HD float hadamard_factor(int i) {
  return (kHadamardNegative >> i) & 1u ? -0.25f : 0.25f;
}

/// The row vector v (16 floats) times H = S H16 / 4 in place (H16
/// Sylvester's Hadamard matrix, H16[i][j] = (-1)^popcount(i & j)), or times
/// H^T (`inverse`): S / 4 applied (exactly) before the butterflies, or after
/// them for H^T; H16 as 4 stages of sums and differences of the pairs i,
/// i + h (h = 1, 2, 4, 8), the same float32 operations on both devices. V is
/// float, or on the CPU a vector of floats (one lane per tile: several
/// tiles at once, each lane as the float path computes it).
template <class V>
AMPX_HD void hadamard16_tile(V* v, bool inverse) {
  if (!inverse) {
    for (int i = 0; i < 16; ++i) v[i] = v[i] * hadamard_factor(i);
  }
  for (int h = 1; h < 16; h *= 2) {
    for (int base = 0; base < 16; base += 2 * h) {
      for (int i = base; i < base + h; ++i) {
        const V a = v[i], b = v[i + h];
        v[i] = a + b;
        v[i + h] = a - b;
      }
    }
  }
  if (inverse) {
    for (int i = 0; i < 16; ++i) v[i] = v[i] * hadamard_factor(i);
  }
}

}  // namespace block_math
}  // namespace fp8
}  // namespace ampx
