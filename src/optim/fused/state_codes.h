#pragma once

// The moments in fewer bits (MixedPrecisionConfig::state_format), written
// once for both devices as optim_math.h's update is:
//
//   bf16   the fp32 moment rounded stochastically to bfloat16 (its own
//          counter-based stream, 16 bits an element, a 64-bit hash for
//          four neighbouring elements): with beta2 = 0.999 a second moment rounded
//          to nearest never decays (0.999 v rounds back to v: bfloat16's
//          relative spacing is 2^-8 to 2^-7, above 0.001), while stochastic
//          rounding keeps it right on average
//   fp8    E4M3 codes of m / s, s = max(absmax, 1e-12) / 448 for each block
//          (torchao's OptimStateFp8), but that a positive second moment
//          whose nearest code is 0 takes the smallest subnormal's, 1
//          (state_span.cpp's second_moment_code): torchao's flushes it
//   8bit   codes of m / s in bitsandbytes' dynamic tree map (signed for the
//          first moment, unsigned for the second), s = max(absmax, 1e-12) for
//          each block, the code the nearest map value, ties up (torchao's
//          OptimState8bit, quantize_8bit_with_qmap), but that a positive
//          second moment whose nearest code is 0 takes code 1 (the map's
//          smallest value): torchao's flushes it
//
// A block's scale comes from the block's new values, so a moment that decays
// everywhere in its block keeps its codes and decays through the scale.

#include "../../fp8/block/block_math.h"
#include "../../fp8/fp8_math.h"
#include "../../kernels/host_device.h"
#include "optim_math.h"

#include <cstdint>

namespace ampx {
namespace detail {
namespace math {

/// A 256-entry code map, sorted ascending: code c means value[c] times its
/// block's scale.
struct StateMap {
  float value[256];
};

/// bitsandbytes' dynamic tree map of 8 bits, 7 of them exponent at most
/// (torchao's create_dynamic_map(signed, 7, 8)), each value computed in
/// double and rounded to float32 once: signed [-0.9930, 1] with zero at code
/// 127, unsigned [0, 1]. Host only (state_tables.cpp); the tests compare it
/// with torchao's.
const StateMap& dynamic_map(bool is_signed);

/// The code of zero in the signed and unsigned maps.
constexpr uint8_t kSignedZeroCode = 127;
constexpr uint8_t kUnsignedZeroCode = 0;

/// The last code whose map value is <= x (0 where none is, or x is NaN): a
/// branchless binary search (torchao's quantize_8bit_with_qmap).
AMPX_HD int map_floor(const StateMap& map, float x) {
  const float* q = map.value;
  int c = x >= q[128] ? 128 : 0;
  c += x >= q[c + 64] ? 64 : 0;
  c += x >= q[c + 32] ? 32 : 0;
  c += x >= q[c + 16] ? 16 : 0;
  c += x >= q[c + 8] ? 8 : 0;
  c += x >= q[c + 4] ? 4 : 0;
  c += x >= q[c + 2] ? 2 : 0;
  c += x >= q[c + 1] ? 1 : 0;
  return c;
}

/// Code `floor` (map_floor's of x), or one up where x is at least halfway
/// to the next value (torchao's tie rule).
AMPX_HD uint8_t map_round(const StateMap& map, int floor, float x) {
  const float* q = map.value;
  const int up = floor + 1 < 255 ? floor + 1 : 255;
  return static_cast<uint8_t>(x - q[floor] >= (q[up] - q[floor]) * 0.5f ? up : floor);
}

/// The nearest map value's code of x (x in [-1, 1]: a value over its block's
/// absmax).
AMPX_HD uint8_t map_code(const StateMap& map, float x) {
  return map_round(map, map_floor(map, x), x);
}

/// A block's absmax floored as torchao floors it (so that an all-zero block
/// has a scale and codes of zero).
AMPX_HD float floored_absmax(float absmax) {
  return absmax > 1e-12f ? absmax : 1e-12f;
}

/// The FP8 format's scale of a block whose absmax is `absmax`.
AMPX_HD float fp8_state_scale(float absmax) {
  return floored_absmax(absmax) / 448.0f;
}

/// The E4M3 code of x / scale, x in a block of scale `scale` (nearest even,
/// saturated).
AMPX_HD uint8_t fp8_state_code(float quotient) {
  return fp8::math::encode<fp8::math::Format::kE4M3>(quotient);
}

/// A second moment's FP8 or 8-bit code from its nearest code: a positive q
/// whose nearest code is 0 takes code 1 (state_span.cpp's second_moment_code,
/// lane by lane, says why).
AMPX_HD uint32_t second_moment_floor(uint32_t code, float q) {
  return q > 0.f && code == 0u ? 1u : code;
}

/// The value of E4M3 code `code` in a block of scale `scale`.
AMPX_HD float fp8_state_value(uint8_t code, float scale) {
  return fp8::block_math::e4m3_value(code) * scale;
}

/// x rounded stochastically to bfloat16's bits by 16 random bits.
AMPX_HD uint16_t bf16_state_bits(float x, uint32_t random16) {
  return bf16_bits_stochastic(x, random16);
}

/// The bfloat16 bits' value.
AMPX_HD float bf16_state_value(uint16_t bits) {
  return bits_float(static_cast<uint32_t>(bits) << 16);
}

/// The hash of elements [4 group, 4 group + 4) of a bf16 moment's stream:
/// 16 random bits an element, element 4 group + j taking bits [16 j, 16 j + 16).
AMPX_HD uint64_t bf16_state_hash(uint64_t stream, int64_t group) {
  return mix64(stream + static_cast<uint64_t>(group) * 0x9e3779b97f4a7c15ULL);
}

/// The 16 random bits of element `index` of a bf16 moment's stream.
AMPX_HD uint32_t bf16_state_random(uint64_t stream, int64_t index) {
  return static_cast<uint32_t>(bf16_state_hash(stream, index >> 2) >> (16 * (index & 3))) & 0xFFFFu;
}

/// The 8-bit code of a float of bits u, not NaN, from its bucket's entry
/// (state_tiles.h's map_buckets: the floats that share u's top 16 bits). A
/// bucket's key orders its floats by value: the low 16 bits, flipped where
/// negative; the entry holds the code of the bucket's lowest value (bits
/// 0-7) and the key from which the code is one higher (bits 8-24; 0x10000:
/// none).
AMPX_HD uint32_t map_bucket_code(uint32_t entry, uint32_t u) {
  const uint32_t key = (u ^ static_cast<uint32_t>(static_cast<int32_t>(u) >> 31)) & 0xFFFFu;
  return (entry & 0xFFu) + (key >= (entry >> 8) ? 1u : 0u);
}

/// The stream key of a moment's stochastic rounding at a step: the update's
/// key (seed, step, param position) and which moment (0: first, 1: second).
AMPX_HD uint64_t state_key(uint64_t update_key, int moment) {
  return mix64(update_key ^ (moment == 0 ? 0x6a09e667f3bcc909ULL : 0xbb67ae8584caa73bULL));
}

}  // namespace math
}  // namespace detail
}  // namespace ampx
