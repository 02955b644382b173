#pragma once

// The CPU's side of the moments in fewer bits and of Kahan weights
// (state_codes.h): a tile's moments decoded into fp32 and encoded back, a
// Kahan weight read as fp32 and its lost bits written. cpu_span.cpp's
// tiles call these once per tile, around the fp32 loops.

#include "fused_step.h"

#include <cstdint>

namespace ampx {
namespace optim {
namespace detail {

/// The largest block of the FP8 and 8-bit moments (elements per scale).
constexpr int64_t kMaxStateBlock = 4096;

/// Moment `moment` (0: first, 1: second) of elements [b, b + n) of p,
/// decoded into out[0, n).
void decode_moment(const FusedParam& p, int moment, int64_t b, int64_t n, float* out);

/// in[0, n) encoded as moment `moment` of elements [b, b + n) of p; for a
/// block format, [b, b + n) is one block and its scale is written too.
/// `key`: the update's key (bf16's stochastic rounding).
void encode_moment(const FusedParam& p, uint64_t key, int moment, int64_t b, int64_t n,
                   const float* in);

/// The Kahan weight param + compensation of elements [b, b + n), in fp32.
void read_kahan_weight(const FusedParam& p, int64_t b, int64_t n, float* w);

/// The compensation T(w - param) of elements [b, b + n), after the param
/// was written as the nearest T of w.
void write_compensation(const FusedParam& p, int64_t b, int64_t n, const float* w);

}  // namespace detail
}  // namespace optim
}  // namespace ampx
