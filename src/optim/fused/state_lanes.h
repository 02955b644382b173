#pragma once

// The lanes the state codecs (state_span.cpp) are written over, once for
// every build: `Lanes` is this build's vector of 32-bit lanes (16 with
// AVX-512, 8 with AVX2, 1 in the baseline build), `ScalarLanes` the one lane
// every build's tails run. Each operation is the integer or IEEE float
// operation of each lane, so a codec gives the same bits in every lane
// width. Included only by sources compiled per instruction set.

#include "../../kernels/host_device.h"

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {

/// The fp16 bits of x, rounded to nearest even, NaN as sign | 0x7E00: the
/// FP16 library's conversion (c10::Half's in LibTorch 1.13), written out
/// because newer c10 converts with F16C in AVX2 builds, which keeps a NaN's
/// payload.
inline uint16_t fp16_bits(float f) {
  const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = float_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = float_bits(base);
  const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

struct ScalarLanes {
  static constexpr int kWidth = 1;
  using I = uint32_t;  // 32-bit integer lanes
  using F = float;
  using M = bool;  // a lane mask
  static I u8(const uint8_t* p) { return *p; }
  static I u16(const uint16_t* p) { return *p; }
  static void store_u8(uint8_t* p, I v) { *p = static_cast<uint8_t>(v); }
  static void store_u16(uint16_t* p, I v) { *p = static_cast<uint16_t>(v); }
  static F load(const float* p) { return *p; }
  static void store(float* p, F v) { *p = v; }
  static I set(uint32_t c) { return c; }
  static F setf(float c) { return c; }
  static I bits(F x) { return float_bits(x); }
  static F floats(I u) { return bits_float(u); }
  static I add(I a, I b) { return a + b; }
  static I sub(I a, I b) { return a - b; }
  static I and_(I a, I b) { return a & b; }
  static I or_(I a, I b) { return a | b; }
  static I xor_(I a, I b) { return a ^ b; }
  template <int S>
  static I srl(I a) {
    return a >> S;
  }
  template <int S>
  static I sll(I a) {
    return a << S;
  }
  template <int S>
  static I sra(I a) {
    return static_cast<uint32_t>(static_cast<int32_t>(a) >> S);
  }
  static M eq(I a, I b) { return a == b; }
  static M gt(I a, I b) { return static_cast<int32_t>(a) > static_cast<int32_t>(b); }  // signed
  static M ltf(F a, F b) { return a < b; }
  static M gef(F a, F b) { return a >= b; }
  static M nan(F a) { return a != a; }
  static I select(M m, I a, I b) { return m ? a : b; }
  static F selectf(M m, F a, F b) { return m ? a : b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F addf(F a, F b) { return a + b; }
  static F subf(F a, F b) { return a - b; }
  static I trunc(F a) { return static_cast<uint32_t>(static_cast<int32_t>(a)); }
  static I max(I a, I b) { return static_cast<int32_t>(a) > static_cast<int32_t>(b) ? a : b; }
  static I gather(const uint32_t* t, I i) { return t[i]; }
  static F gatherf(const float* t, I i) { return t[i]; }
  static F halves(const uint16_t* p) {
    return static_cast<float>(c10::Half(*p, c10::Half::from_bits()));
  }
  static void store_halves(uint16_t* p, F x) { *p = fp16_bits(x); }
};

#if defined(CPU_CAPABILITY_AVX512)

struct VectorLanes {
  static constexpr int kWidth = 16;
  using I = __m512i;
  using F = __m512;
  using M = __mmask16;
  static I u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static I u16(const uint16_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  }
  static void store_u8(uint8_t* p, I v) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(v)); }
  static void store_u16(uint16_t* p, I v) {
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(v));
  }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static I set(uint32_t c) { return _mm512_set1_epi32(static_cast<int>(c)); }
  static F setf(float c) { return _mm512_set1_ps(c); }
  static I bits(F x) { return _mm512_castps_si512(x); }
  static F floats(I u) { return _mm512_castsi512_ps(u); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  template <int S>
  static I srl(I a) {
    return _mm512_srli_epi32(a, S);
  }
  template <int S>
  static I sll(I a) {
    return _mm512_slli_epi32(a, S);
  }
  template <int S>
  static I sra(I a) {
    return _mm512_srai_epi32(a, S);
  }
  static M eq(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
  static M gt(I a, I b) { return _mm512_cmpgt_epi32_mask(a, b); }
  static M ltf(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M gef(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  static M nan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  static I select(M m, I a, I b) { return _mm512_mask_blend_epi32(m, b, a); }
  static F selectf(M m, F a, F b) { return _mm512_mask_blend_ps(m, b, a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F addf(F a, F b) { return _mm512_add_ps(a, b); }
  static F subf(F a, F b) { return _mm512_sub_ps(a, b); }
  static I trunc(F a) { return _mm512_cvttps_epi32(a); }
  static I max(I a, I b) { return _mm512_max_epi32(a, b); }
  static I gather(const uint32_t* t, I i) { return _mm512_i32gather_epi32(i, t, 4); }
  static F gatherf(const float* t, I i) { return _mm512_i32gather_ps(i, t, 4); }
  static F halves(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
  }
  static void store_halves(uint16_t* p, F x) {
    // NaN as sign | 0x7E00 (fp16_bits'): a quiet NaN with no payload converts to it
    const F quiet = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_and_si512(bits(x), set(0x80000000u)), set(0x7FC00000u)));
    const __m256i h = _mm512_cvtps_ph(selectf(nan(x), quiet, x), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256((__m256i*)p, h);
  }
};

/// mix64 (optim_math.h) of each 64-bit lane.
inline __m512i mix64(__m512i z) {
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)),
                         _mm512_set1_epi64(static_cast<int64_t>(0xbf58476d1ce4e5b9ULL)));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)),
                         _mm512_set1_epi64(static_cast<int64_t>(0x94d049bb133111ebULL)));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

/// base + j * 0x9e3779b97f4a7c15, j = 0..7.
inline __m512i golden_steps(uint64_t base) {
  constexpr uint64_t kG = 0x9e3779b97f4a7c15ULL;
  const auto at = [](uint64_t j) { return static_cast<int64_t>(j * kG); };
  return _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(base)),
                          _mm512_set_epi64(at(7), at(6), at(5), at(4), at(3), at(2), at(1), 0));
}

/// The random bits of 32 consecutive elements of a bf16 moment's stream
/// (bf16_state_hash of 8 groups from base = stream + first group x G), 16
/// each, in two vectors of 16 lanes.
inline void bf16_state_randoms(uint64_t base, __m512i& r0, __m512i& r1) {
  const __m512i z = mix64(golden_steps(base));
  // little-endian: the hashes' 16-bit pieces are the elements' in order
  r0 = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(z));
  r1 = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(z, 1));
}

/// sr_bits (optim_math.h) of 16 consecutive elements, base = key + first x G.
inline __m512i sr_randoms(uint64_t base) {
  const __m512i a = _mm512_srli_epi64(mix64(golden_steps(base)), 48);
  const __m512i b = _mm512_srli_epi64(mix64(golden_steps(base + 8 * 0x9e3779b97f4a7c15ULL)), 48);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(a)),
                            _mm512_cvtepi64_epi32(b), 1);
}

#elif defined(CPU_CAPABILITY_AVX2)

struct VectorLanes {
  static constexpr int kWidth = 8;
  using I = __m256i;
  using F = __m256;
  using M = __m256i;  // all ones where set
  static I u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static I u16(const uint16_t* p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  }
  static void store_u8(uint8_t* p, I v) {  // each lane's low byte (lanes hold 0..255)
    const __m256i b = _mm256_shuffle_epi8(
        v, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8,
                            12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    _mm_storel_epi64((__m128i*)p, _mm_unpacklo_epi32(lo, hi));
  }
  static void store_u16(uint16_t* p, I v) {       // lanes hold 0..65535
    const __m256i w = _mm256_packus_epi32(v, v);  // 0-3 0-3 | 4-7 4-7
    _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(w, 0x08)));
  }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static I set(uint32_t c) { return _mm256_set1_epi32(static_cast<int>(c)); }
  static F setf(float c) { return _mm256_set1_ps(c); }
  static I bits(F x) { return _mm256_castps_si256(x); }
  static F floats(I u) { return _mm256_castsi256_ps(u); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  template <int S>
  static I srl(I a) {
    return _mm256_srli_epi32(a, S);
  }
  template <int S>
  static I sll(I a) {
    return _mm256_slli_epi32(a, S);
  }
  template <int S>
  static I sra(I a) {
    return _mm256_srai_epi32(a, S);
  }
  static M eq(I a, I b) { return _mm256_cmpeq_epi32(a, b); }
  static M gt(I a, I b) { return _mm256_cmpgt_epi32(a, b); }
  static M ltf(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  static M gef(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
  static M nan(F a) { return _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
  static I select(M m, I a, I b) { return _mm256_blendv_epi8(b, a, m); }
  static F selectf(M m, F a, F b) { return _mm256_blendv_ps(b, a, _mm256_castsi256_ps(m)); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F addf(F a, F b) { return _mm256_add_ps(a, b); }
  static F subf(F a, F b) { return _mm256_sub_ps(a, b); }
  static I trunc(F a) { return _mm256_cvttps_epi32(a); }
  static I max(I a, I b) { return _mm256_max_epi32(a, b); }
  static I gather(const uint32_t* t, I i) { return _mm256_i32gather_epi32((const int*)t, i, 4); }
  static F gatherf(const float* t, I i) { return _mm256_i32gather_ps(t, i, 4); }
  static F halves(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static void store_halves(uint16_t* p, F x) {
    // NaN as sign | 0x7E00 (fp16_bits'): a quiet NaN with no payload converts to it
    const F quiet =
        floats(_mm256_or_si256(_mm256_and_si256(bits(x), set(0x80000000u)), set(0x7FC00000u)));
    const __m128i h = _mm256_cvtps_ph(selectf(nan(x), quiet, x), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128((__m128i*)p, h);
  }
};

/// The low 64 bits of a * c in each 64-bit lane (AVX2 has no vpmullq).
inline __m256i mul64(__m256i a, uint64_t c) {
  const __m256i lo = _mm256_set1_epi64x(static_cast<int64_t>(c & 0xFFFFFFFFu));
  const __m256i hi = _mm256_set1_epi64x(static_cast<int64_t>(c >> 32));
  const __m256i cross =
      _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), lo), _mm256_mul_epu32(a, hi));
  return _mm256_add_epi64(_mm256_mul_epu32(a, lo), _mm256_slli_epi64(cross, 32));
}

inline __m256i mix64(__m256i z) {
  z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), 0xbf58476d1ce4e5b9ULL);
  z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), 0x94d049bb133111ebULL);
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

/// base + j * 0x9e3779b97f4a7c15, j = 0..3.
inline __m256i golden_steps(uint64_t base) {
  constexpr uint64_t kG = 0x9e3779b97f4a7c15ULL;
  const auto at = [](uint64_t j) { return static_cast<int64_t>(j * kG); };
  return _mm256_add_epi64(_mm256_set1_epi64x(static_cast<int64_t>(base)),
                          _mm256_set_epi64x(at(3), at(2), at(1), 0));
}

/// The random bits of 16 consecutive elements of a bf16 moment's stream
/// (4 groups), in two vectors of 8 lanes.
inline void bf16_state_randoms(uint64_t base, __m256i& r0, __m256i& r1) {
  const __m256i z = mix64(golden_steps(base));
  r0 = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(z));
  r1 = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(z, 1));
}

/// sr_bits of 8 consecutive elements, base = key + first x G.
inline __m256i sr_randoms(uint64_t base) {
  const __m256i low = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // each lane's low half first
  const __m256i a =
      _mm256_permutevar8x32_epi32(_mm256_srli_epi64(mix64(golden_steps(base)), 48), low);
  const __m256i b = _mm256_permutevar8x32_epi32(
      _mm256_srli_epi64(mix64(golden_steps(base + 4 * 0x9e3779b97f4a7c15ULL)), 48), low);
  return _mm256_inserti128_si256(a, _mm256_castsi256_si128(b), 1);
}

#else

using VectorLanes = ScalarLanes;

#endif

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
