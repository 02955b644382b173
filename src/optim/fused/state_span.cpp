// The state codecs of the CPU step's tiles (state_tiles.h), compiled once per
// instruction set as cpu_span.cpp is. Each codec is written once, over
// state_lanes.h's lanes: this build's vectors for the body, one lane for
// the tails (and the whole of the baseline build), the same integer and
// IEEE float operations in every lane, so every build writes the same bits
// (OptimStateCodecsTest compares them with a scalar reference):
//   bf16   the moment rounded stochastically, one hash for four elements
//          (state_codes.h's bf16_state_hash), 32 elements (AVX-512) or 16
//          (AVX2) a step
//   fp8    absmax, then x / scale and the E4M3 code without branches
//          (fp8/element_code.h's encode_branchless, lane by lane);
//          decoding the code's fields moved into a float's (e4m3_value)
//   8bit   absmax, then x / scale and one gather of its bucket's entry
//          (state_tables.cpp's map_buckets); decoding a lookup in the
//          256 map values (Table256: permutes with AVX-512, else a gather)
//   Kahan  bf16 or fp16 widened and added; the compensation rounded to
//          nearest even, NaN as c10's scalar conversions write it
// and the bf16 weight's stochastic rounding (fused_step.h's Narrow: one
// hash an element), which the tiles of cpu_span.cpp call too.

#include "state_tiles.h"

#include "state_codes.h"
#include "state_lanes.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

using optim::detail::FusedDtype;
using optim::detail::FusedState;
using S = ScalarLanes;
using V = VectorLanes;

/// Runs body.template operator()<V>(k) over [0, n) in steps of V's width,
/// then body.template operator()<S>(k) over the rest.
template <class Body>
void for_lanes(int64_t n, const Body& body) {
  int64_t k = 0;
  if constexpr (V::kWidth > 1) {
    for (; k + V::kWidth <= n; k += V::kWidth) body.template operator()<V>(k);
  }
  for (; k < n; ++k) body.template operator()<S>(k);
}

// ---- codes of one lane vector ------------------------------------------------

/// bf16_bits_stochastic (optim_math.h): x's bits plus 16 random bits, the top
/// 16 kept; inf as it is, NaN as 0x7FC0.
template <class L>
typename L::I bf16_round(typename L::F x, typename L::I random) {
  const auto u = L::bits(x);
  const auto special = L::eq(L::and_(u, L::set(0x7F800000u)), L::set(0x7F800000u));
  const auto nan = L::gt(L::and_(u, L::set(0x7FFFFFFFu)), L::set(0x7F800000u));
  auto r = L::template srl<16>(L::add(u, random));
  r = L::select(special, L::template srl<16>(u), r);
  return L::select(nan, L::set(0x7FC0u), r);
}

/// The E4M3 code of q (fp8_state_code: encode_branchless<3, 7, 8, true>).
template <class L>
typename L::I fp8_code(typename L::F q) {
  const auto u = L::bits(q);
  const auto mag = L::and_(u, L::set(0x7FFFFFFFu));
  const auto a = L::floats(mag);
  const auto rounded =
      L::add(L::add(mag, L::set((1u << 19) - 1)), L::and_(L::template srl<20>(mag), L::set(1u)));
  const auto normal = L::sub(L::template srl<20>(rounded), L::set((127u - 7u) << 3));
  const auto k15 = L::setf(12582912.0f);  // 1.5 x 2^23
  const auto below = L::trunc(L::subf(L::addf(L::mul(a, L::setf(512.0f)), k15), k15));
  auto code = L::select(L::ltf(a, L::setf(1.0f / 64.0f)), below, normal);
  code = L::select(L::gef(a, L::setf(448.0f)), L::set(0x7Eu), code);
  code = L::select(L::gt(mag, L::set(0x7F800000u)), L::set(0x7Fu), code);
  return L::or_(L::template sll<7>(L::template srl<31>(u)), code);
}

/// A second moment's code: a positive q whose nearest code is 0 takes code 1
/// instead (FP8: the smallest subnormal, 2^-9 of the scale; 8-bit: the
/// unsigned map's smallest value, 3.25e-7 of it). A block spans 2^17.8 in v
/// in FP8 and 2^22.5 in 8 bits, half that in the gradient, while the first
/// moment, linear in the gradient, spans twice as much: an element could
/// keep its m and lose its v, and the next step divide m by
/// sqrt(0.001 g^2), or by eps. Rounded up instead, its step is damped, never
/// blown up (the zero-point problem of 4-bit optimizers, Li et al. 2023).
/// (state_codes.h's second_moment_floor, lane by lane.)
template <class L>
typename L::I second_moment_code(typename L::I code, typename L::F q) {
  return L::select(L::ltf(L::setf(0.0f), q), L::max(code, L::set(1u)), code);
}

/// The 8-bit code of q (map_bucket_code of its bucket's entry; NaN: 0).
template <class L>
typename L::I map_code(const uint32_t* buckets, typename L::F q) {
  const auto u = L::bits(q);
  const auto entry = L::gather(buckets, L::template srl<16>(u));
  const auto key = L::and_(L::xor_(u, L::template sra<31>(u)), L::set(0xFFFFu));
  const auto up = L::select(L::gt(L::template srl<8>(entry), key), L::set(0u), L::set(1u));
  const auto code = L::add(L::and_(entry, L::set(0xFFu)), up);
  return L::select(L::nan(q), L::set(0u), code);
}

/// The nearest-even bf16 bits of x, NaN as 0x7FC0 (c10::BFloat16's).
template <class L>
typename L::I bf16_nearest(typename L::F x) {
  const auto u = L::bits(x);
  const auto bias = L::add(L::set(0x7FFFu), L::and_(L::template srl<16>(u), L::set(1u)));
  return L::select(L::nan(x), L::set(0x7FC0u), L::template srl<16>(L::add(u, bias)));
}

// ---- tiles ---------------------------------------------------------------------

/// The largest |x| of x[0, n); NaN where any is NaN (as torch's amax). On
/// the bits: |x|'s order is its bits' order, and NaNs' bits are above +inf's.
float absmax_of(const float* x, int64_t n) {
  V::I acc_v = V::set(0u);
  S::I acc = 0u;
  const auto body = [&]<class L>(int64_t k) {
    const auto mag = L::and_(L::bits(L::load(x + k)), L::set(0x7FFFFFFFu));
    if constexpr (L::kWidth == 1)
      acc = S::max(acc, mag);
    else
      acc_v = V::max(acc_v, mag);
  };
  for_lanes(n, body);
  alignas(64) uint32_t lanes[V::kWidth];
  std::memcpy(lanes, &acc_v, sizeof lanes);
  for (int j = 0; j < V::kWidth; ++j) acc = S::max(acc, lanes[j]);
  return acc > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN() : bits_float(acc);
}

void encode_bf16(uint64_t stream, int64_t index, int64_t n, const float* in, uint16_t* out) {
  int64_t k = 0;
  const auto scalar_to = [&](int64_t end) {  // one hash for four elements, as the step always did
    uint64_t h = 0;
    for (int64_t first = k; k < end; ++k) {
      const int64_t i = index + k;
      if (k == first || (i & 3) == 0) h = math::bf16_state_hash(stream, i >> 2);
      const uint32_t random = static_cast<uint32_t>(h >> (16 * (i & 3))) & 0xFFFFu;
      out[k] = static_cast<uint16_t>(bf16_round<S>(in[k], random));
    }
  };
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  constexpr int64_t kStep = 2 * V::kWidth;  // elements of one bf16_state_randoms
  scalar_to(std::min(n, (4 - (index & 3)) & 3));
  uint64_t base = stream + static_cast<uint64_t>((index + k) >> 2) * 0x9e3779b97f4a7c15ULL;
  for (; k + kStep <= n; k += kStep, base += (kStep / 4) * 0x9e3779b97f4a7c15ULL) {
    V::I r0, r1;
    bf16_state_randoms(base, r0, r1);
    V::store_u16(out + k, bf16_round<V>(V::load(in + k), r0));
    V::store_u16(out + k + V::kWidth, bf16_round<V>(V::load(in + k + V::kWidth), r1));
  }
#endif
  scalar_to(n);
}

/// A block's codes: q = x / scale, code(q) (fp8_code or map_code).
template <class Code>
void encode_block(const float* in, int64_t n, float scale, uint8_t* out, const Code& code) {
  for_lanes(n, [&]<class L>(int64_t k) {
    L::store_u8(out + k, code.template operator()<L>(L::div(L::load(in + k), L::setf(scale))));
  });
}

/// The value of E4M3 code c at scale 1 (fp8_state_value(c, 1)) without a table:
/// a normal's exponent and mantissa moved into a float's fields; a
/// subnormal m 2^-9 as 2^-6 (1 + m / 8) - 2^-6, exact; 0x7F and 0xFF NaN
/// with the code's sign.
template <class L>
typename L::F e4m3_value(typename L::I c) {
  const auto mag = L::and_(c, L::set(0x7Fu));
  const auto sign = L::template sll<24>(L::and_(c, L::set(0x80u)));
  const auto fields = L::template sll<20>(mag);
  const auto normal = L::floats(L::add(fields, L::set(120u << 23)));
  const auto subnormal =
      L::subf(L::floats(L::add(fields, L::set(121u << 23))), L::setf(1.0f / 64.0f));
  auto v = L::bits(L::selectf(L::gt(L::set(8u), mag), subnormal, normal));
  v = L::select(L::eq(mag, L::set(0x7Fu)), L::set(0x7FC00000u), v);
  return L::floats(L::or_(v, sign));
}

/// Entry i of a 256-entry table, gathered (ScalarLanes, AVX2) or, with
/// AVX-512, picked by eight two-register permutes and a tree of blends on
/// the index's top three bits: a gather of 16 lanes costs two to three times
/// as much on Zen 4 and on Intel's cores since the gather data sampling
/// microcode.
template <class L>
struct Table256 {
  const float* table;
  explicit Table256(const float* t) : table(t) {}
  typename L::F operator()(typename L::I i) const { return L::gatherf(table, i); }
};

#if defined(CPU_CAPABILITY_AVX512)
template <>
struct Table256<VectorLanes> {
  __m512 t[16];
  explicit Table256(const float* table) {
    for (int j = 0; j < 16; ++j) t[j] = _mm512_loadu_ps(table + 16 * j);
  }
  __m512 operator()(__m512i i) const {  // written out: GCC keeps a loop's r[] in memory
    const auto pair = [&](int j) { return _mm512_permutex2var_ps(t[2 * j], i, t[2 * j + 1]); };
    const __mmask16 b5 = _mm512_test_epi32_mask(i, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(i, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(i, _mm512_set1_epi32(128));
    const __m512 r01 = _mm512_mask_blend_ps(b5, pair(0), pair(1));
    const __m512 r23 = _mm512_mask_blend_ps(b5, pair(2), pair(3));
    const __m512 r45 = _mm512_mask_blend_ps(b5, pair(4), pair(5));
    const __m512 r67 = _mm512_mask_blend_ps(b5, pair(6), pair(7));
    return _mm512_mask_blend_ps(b7, _mm512_mask_blend_ps(b6, r01, r23),
                                _mm512_mask_blend_ps(b6, r45, r67));
  }
};
#endif

void decode_fp8(const uint8_t* codes, float scale, int64_t n, float* out) {
  for_lanes(n, [&]<class L>(int64_t k) {
    L::store(out + k, L::mul(e4m3_value<L>(L::u8(codes + k)), L::setf(scale)));
  });
}

void decode_map(const uint8_t* codes, const Table256<V>& map_v, const Table256<S>& map_s,
                float scale, int64_t n, float* out) {
  for_lanes(n, [&]<class L>(int64_t k) {
    typename L::F value;
    if constexpr (L::kWidth == 1)
      value = map_s(L::u8(codes + k));
    else
      value = map_v(L::u8(codes + k));
    L::store(out + k, L::mul(value, L::setf(scale)));
  });
}

float* scales_of(const FusedParam& p, int moment) {
  return moment == 0 ? p.exp_avg_scale : p.exp_avg_sq_scale;
}

/// Elements [b, b + n) of a block format's moment, whole blocks (a param's
/// last may be shorter), each encoded by block(in, nb, codes), which returns
/// the block's scale.
template <class Block>
void for_blocks(const FusedParam& p, int moment, int64_t b, int64_t n, const float* in,
                const Block& block) {
  auto* codes = static_cast<uint8_t*>(moment == 0 ? p.exp_avg_codes : p.exp_avg_sq_codes);
  for (int64_t o = 0; o < n; o += p.state_block) {
    const int64_t nb = std::min<int64_t>(p.state_block, n - o);
    scales_of(p, moment)[(b + o) / p.state_block] = block(in + o, nb, codes + b + o);
  }
}

/// The read side of for_blocks: each whole block of [b, b + n) (a param's
/// last may be shorter) decoded by block(codes, scale, nb, out).
template <class Block>
void for_coded_blocks(const FusedParam& p, int moment, int64_t b, int64_t n, float* out,
                      const Block& block) {
  const auto* codes =
      static_cast<const uint8_t*>(moment == 0 ? p.exp_avg_codes : p.exp_avg_sq_codes);
  for (int64_t o = 0; o < n; o += p.state_block) {
    block(codes + b + o, scales_of(p, moment)[(b + o) / p.state_block],
          std::min<int64_t>(p.state_block, n - o), out + o);
  }
}

}  // namespace

void decode_moment(const FusedParam& p, int moment, int64_t b, int64_t n, float* out) {
  const void* codes = moment == 0 ? p.exp_avg_codes : p.exp_avg_sq_codes;
  switch (p.state_format) {
    case FusedState::kBf16: {
      const auto* c = static_cast<const uint16_t*>(codes) + b;
      for_lanes(n, [&]<class L>(int64_t k) {
        L::store(out + k, L::floats(L::template sll<16>(L::u16(c + k))));
      });
      return;
    }
    case FusedState::kFp8:
      for_coded_blocks(p, moment, b, n, out, decode_fp8);
      return;
    case FusedState::kInt8: {
      const float* map = optim::detail::dynamic_map_table(moment == 0);
      const Table256<V> map_v(map);  // the AVX-512 build's registers, loaded once a call
      const Table256<S> map_s(map);
      for_coded_blocks(p, moment, b, n, out,
                       [&](const uint8_t* c, float scale, int64_t nb, float* o) {
                         decode_map(c, map_v, map_s, scale, nb, o);
                       });
      return;
    }
    case FusedState::kFp32:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "ampx::optim: fp32 moments are not decoded");
}

void encode_moment(const FusedParam& p, uint64_t key, int moment, int64_t b, int64_t n,
                   const float* in) {
  void* codes = moment == 0 ? p.exp_avg_codes : p.exp_avg_sq_codes;
  switch (p.state_format) {
    case FusedState::kBf16:
      encode_bf16(math::state_key(key, moment), p.index_base + b, n, in,
                  static_cast<uint16_t*>(codes) + b);
      return;
    case FusedState::kFp8:
      for_blocks(p, moment, b, n, in, [moment](const float* x, int64_t nb, uint8_t* out) {
        const float scale = math::fp8_state_scale(absmax_of(x, nb));
        if (moment == 0) {
          encode_block(x, nb, scale, out, []<class L>(typename L::F q) { return fp8_code<L>(q); });
        } else {
          encode_block(x, nb, scale, out, []<class L>(typename L::F q) {
            return second_moment_code<L>(fp8_code<L>(q), q);
          });
        }
        return scale;
      });
      return;
    case FusedState::kInt8: {
      const uint32_t* buckets = optim::detail::map_buckets(moment == 0);
      for_blocks(p, moment, b, n, in, [buckets, moment](const float* x, int64_t nb, uint8_t* out) {
        const float scale = math::floored_absmax(absmax_of(x, nb));
        if (moment == 0) {
          encode_block(x, nb, scale, out,
                       [buckets]<class L>(typename L::F q) { return map_code<L>(buckets, q); });
        } else {
          encode_block(x, nb, scale, out, [buckets]<class L>(typename L::F q) {
            return second_moment_code<L>(map_code<L>(buckets, q), q);
          });
        }
        return scale;
      });
      return;
    }
    case FusedState::kFp32:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "ampx::optim: fp32 moments are not encoded");
}

void bf16_stochastic_weights(const float* w, int64_t n, uint64_t key, int64_t index,
                             uint16_t* out) {
  for_lanes(n, [&]<class L>(int64_t k) {
    typename L::I random;
    if constexpr (L::kWidth == 1) {
      random = math::sr_bits(key, index + k);
    }
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    else {
      random = sr_randoms(key + static_cast<uint64_t>(index + k) * 0x9e3779b97f4a7c15ULL);
    }
#endif
    L::store_u16(out + k, bf16_round<L>(L::load(w + k), random));
  });
}

void read_kahan_weight(const FusedParam& p, int64_t b, int64_t n, float* w) {
  const auto* param = static_cast<const uint16_t*>(p.param) + b;
  const auto* comp = static_cast<const uint16_t*>(p.compensation) + b;
  if (p.dtype == FusedDtype::kBFloat16) {
    for_lanes(n, [&]<class L>(int64_t k) {
      const auto x = L::floats(L::template sll<16>(L::u16(param + k)));
      L::store(w + k, L::addf(x, L::floats(L::template sll<16>(L::u16(comp + k)))));
    });
  } else {
    for_lanes(n, [&]<class L>(int64_t k) {
      L::store(w + k, L::addf(L::halves(param + k), L::halves(comp + k)));
    });
  }
}

void write_compensation(const FusedParam& p, int64_t b, int64_t n, const float* w) {
  const auto* param = static_cast<const uint16_t*>(p.param) + b;
  auto* comp = static_cast<uint16_t*>(p.compensation) + b;
  if (p.dtype == FusedDtype::kBFloat16) {
    for_lanes(n, [&]<class L>(int64_t k) {
      const auto x = L::floats(L::template sll<16>(L::u16(param + k)));
      L::store_u16(comp + k, bf16_nearest<L>(L::subf(L::load(w + k), x)));
    });
  } else {
    for_lanes(n, [&]<class L>(int64_t k) {
      L::store_halves(comp + k, L::subf(L::load(w + k), L::halves(param + k)));
    });
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
