#pragma once

// Float32 vector math shared by the span kernels compiled once per
// instruction set: an exp and a reciprocal that the AVX2 and AVX-512 builds
// compute with the same formula, with no library behind them, and the sum
// of a vector's lanes. at::vec's exp calls SLEEF only where LibTorch links it
// as a shared library (Debian's); pip wheels and the zip from pytorch.org
// link it inside libtorch_cpu, and the fallback, libm lane by lane, made a
// bfloat16 GELU or softmax several times slower there. Include from a file
// compiled with CPU_CAPABILITY defined.

#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {

using VecF = at::vec::Vectorized<float>;

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// v * 2^n for whole-number n in [-150, 128] (as exp_of and exp_of_nonpositive
// need them), rounded once.
inline VecF times_pow2(const VecF& v, const VecF& n) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_scalef_ps(v, n);
#else
  // 2^n in two factors, each a normal float for n in [-150, 128]: v times the
  // first is exact, so the product rounds once, subnormal results included.
  const __m256i e = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(e, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 b =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(v, a), b);
#endif
}
#endif

// x < y ? a : b, lane by lane (false where either is NaN). Two instructions
// on AVX-512, where at::vec's comparison (a mask widened to a vector) and
// blendv (the vector compared back into a mask) take four.
inline VecF where_less(const VecF& x, const VecF& y, const VecF& a, const VecF& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, y, _CMP_LT_OQ), b, a);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, y, _CMP_LT_OQ));
#else
  return VecF::blendv(b, a, x < y);
#endif
}

#if !defined(CPU_CAPABILITY_DEFAULT)
// exp(xc) for an argument already clamped to exp_of's range: Cody-Waite
// reduction by ln 2, a degree-6 polynomial, scaling by 2^n. exp_of and
// exp_of_nonpositive differ only in their clamps and range checks.
inline VecF exp_of_clamped(const VecF& xc) {
  const VecF n = (xc * VecF(1.44269504f)).round();
  const VecF r = (xc - n * VecF(0.693359375f)) - n * VecF(-2.12194440e-4f);
  VecF p(1.f / 720);
  p = p * r + VecF(1.f / 120);
  p = p * r + VecF(1.f / 24);
  p = p * r + VecF(1.f / 6);
  p = p * r + VecF(0.5f);
  p = p * r + VecF(1.f);
  p = p * r + VecF(1.f);
  return times_pow2(p, n);
}
#endif

// exp(x) for every float32 x: relative error below 3e-7 where the result is
// a normal float, 0 below exp's normal range (x < -87.3, -inf included),
// inf above it, NaN for NaN. Cody and Waite's reduction x = n ln 2 + r with
// |r| <= ln 2 / 2 and e^r by its Taylor polynomial of degree 6 (truncation
// r^7 / 7! < 1.2e-7).
// (The DEFAULT build, for CPUs without AVX2, calls libm lane by lane, as
// ATen's DEFAULT build does: with no vector registers that is the fastest.)
inline VecF exp_of(const VecF& x) {
#if defined(CPU_CAPABILITY_DEFAULT)
  return x.exp();
#else
  const VecF lo(-87.33654f), hi(88.72283f);
  // min(hi, max(lo, x)): each returns its second operand where one is NaN,
  // so NaN stays NaN (at::vec's NaN-propagating maximum and minimum take
  // four instructions each on AVX-512).
#if defined(CPU_CAPABILITY_AVX512)
  const VecF xc = _mm512_min_ps(hi, _mm512_max_ps(lo, x));
#else
  const VecF xc = _mm256_min_ps(hi, _mm256_max_ps(lo, x));
#endif
  const VecF e = where_less(x, lo, VecF(0.f), exp_of_clamped(xc));
  return where_less(hi, x, VecF(std::numeric_limits<float>::infinity()), e);
#endif
}

// exp(x) for x <= 0 (-inf included) by exp_of's formula, without its range
// checks: below exp's normal range the scaling by 2^n rounds the result to a
// subnormal, and to 0 below -103.3 (arguments are clamped at -104, where n is
// -150). NaN gives NaN. Five instructions fewer than exp_of, for callers whose
// arguments cannot be positive (GELU's exp(-x^2 / 2)).
inline VecF exp_of_nonpositive(const VecF& x) {
#if defined(CPU_CAPABILITY_DEFAULT)
  return x.exp();
#else
#if defined(CPU_CAPABILITY_AVX512)
  const VecF xc = _mm512_max_ps(VecF(-104.f), x);  // (the second operand where one is NaN)
#else
  const VecF xc = _mm256_max_ps(VecF(-104.f), x);
#endif
  return exp_of_clamped(xc);
#endif
}

// 1 / d for d >= 1, with relative error below 3e-7: the hardware's estimate
// and one Newton step (a division costs several times as much on AVX-512).
inline VecF reciprocal_of(const VecF& d) {
#if defined(CPU_CAPABILITY_AVX512)
  const VecF r0 = _mm512_rcp14_ps(d);
#elif defined(CPU_CAPABILITY_AVX2)
  const VecF r0 = _mm256_rcp_ps(d);
#else
  return VecF(1.f) / d;
#endif
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  return r0 * (VecF(2.f) - d * r0);
#endif
}

// The lanes of v summed in lane order in `Sum` (float: the same bits in
// every build whatever the thread count, which the kernels' reductions rely
// on; double for sums of squares over many vectors, LAMB's norms).
template <typename Sum = float>
inline Sum lane_sum(const VecF& v) {
  alignas(64) float lanes[VecF::size()];
  v.store(lanes);
  Sum s = 0;
  for (int64_t l = 0; l < VecF::size(); ++l) s += lanes[l];
  return s;
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
