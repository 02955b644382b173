#pragma once

// The CPU's side of the moments in fewer bits and of Kahan weights
// (state_codes.h): a tile's moments decoded into fp32 and encoded back, a
// Kahan weight read as fp32 and its lost bits written. cpu_span.cpp's
// tiles call these once per tile, around the fp32 loops.
//
// The codecs are compiled once per instruction set (state_span.cpp, in
// ampx::detail::cpu::DEFAULT, AVX2 and AVX512, as cpu_span.cpp is) and give
// the same bits on each: checkpoints do not depend on the CPU that wrote
// them (OptimStateCodecsTest). The tables they read are built once, here.

#include "fused_step.h"

#include "../../kernels/isa/isa_dispatch.h"

#include <cstdint>

namespace ampx {
namespace optim {
namespace detail {

/// The largest block of the FP8 and 8-bit moments (elements per scale).
constexpr int64_t kMaxStateBlock = 4096;

/// The dynamic tree map's 256 values (state_codes.h's dynamic_map).
const float* dynamic_map_table(bool is_signed);

/// The 8-bit codes of the dynamic map, a float's bucket (its top 16 bits)
/// at a time: entry b gives map_code of every non-NaN float of bucket b with
/// map_bucket_code (state_codes.h). Built from map_code's binary search,
/// checking that no bucket spans more than two codes.
const uint32_t* map_buckets(bool is_signed);

// The step's codecs, one best_isa() picks (what optimizer_formats.cpp's
// decoding of whole moments calls; the step calls its own build's).

/// Moment `moment` (0: first, 1: second) of elements [b, b + n) of p,
/// decoded into out[0, n).
void decode_moment(const FusedParam& p, int moment, int64_t b, int64_t n, float* out);

/// in[0, n) encoded as moment `moment` of elements [b, b + n) of p; for a
/// block format, [b, b + n) is whole blocks (the param's last may be
/// shorter), each with its scale written too.
/// `key`: the update's key (bf16's stochastic rounding).
void encode_moment(const FusedParam& p, uint64_t key, int moment, int64_t b, int64_t n,
                   const float* in);

}  // namespace detail
}  // namespace optim

namespace detail {
namespace cpu {

using optim::detail::FusedParam;

#define AMPX_DECLARE_STATE_CODECS(ns)                                                     \
  namespace ns {                                                                          \
  /* optim::detail::decode_moment and encode_moment, this build's. */                     \
  void decode_moment(const FusedParam& p, int moment, int64_t b, int64_t n, float* out);  \
  void encode_moment(const FusedParam& p, uint64_t key, int moment, int64_t b, int64_t n, \
                     const float* in);                                                    \
  /* The Kahan weight param + compensation of elements [b, b + n), in fp32. */            \
  void read_kahan_weight(const FusedParam& p, int64_t b, int64_t n, float* w);            \
  /* The compensation T(w - param) of elements [b, b + n), after the param */             \
  /* was written as the nearest T of w. */                                                \
  void write_compensation(const FusedParam& p, int64_t b, int64_t n, const float* w);     \
  /* w[0, n) rounded stochastically to bf16 bits as fused_step.h's Narrow rounds */       \
  /* elements index.. of a param under `key`. */                                          \
  void bf16_stochastic_weights(const float* w, int64_t n, uint64_t key, int64_t index,    \
                               uint16_t* out);                                            \
  }
AMPX_DECLARE_STATE_CODECS(DEFAULT)
AMPX_DECLARE_STATE_CODECS(AVX2)
AMPX_DECLARE_STATE_CODECS(AVX512)
#undef AMPX_DECLARE_STATE_CODECS

struct StateCodecs {
  void (*decode)(const FusedParam&, int, int64_t, int64_t, float*);
  void (*encode)(const FusedParam&, uint64_t, int, int64_t, int64_t, const float*);
  void (*read_kahan)(const FusedParam&, int64_t, int64_t, float*);
  void (*write_compensation)(const FusedParam&, int64_t, int64_t, const float*);
};

#define AMPX_STATE_CODECS_BUILD(ns)                                                         \
  StateCodecs {                                                                             \
    &ns::decode_moment, &ns::encode_moment, &ns::read_kahan_weight, &ns::write_compensation \
  }
AMPX_ISA_DISPATCH(StateCodecs, state_codecs_for, AMPX_STATE_CODECS_BUILD)
#undef AMPX_STATE_CODECS_BUILD

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
