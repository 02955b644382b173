// The span kernels of ampx's mixed-precision GELU, compiled once per
// instruction set (see activation_kernels.h). The 16-bit input is widened to
// float32, computed in float32 vectors (one exp per element forward and
// backward, vec_math.h's: erf's approximation and the normal density share
// it), and narrowed once: bf16 a vector pair at a time in registers, float16
// and a bf16 span's last partial pair in blocks through a float32 buffer,
// whose tail is padded to whole vectors, so every element goes through the
// same vector code wherever it lies.

#include "activation_kernels.h"
#include "span_convert.h"
#include "vec_math.h"

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kBlock = 1024;  // float32 elements per buffer: 4 KiB, in L1
constexpr float kAlpha = static_cast<float>(M_SQRT1_2);
constexpr float kBeta = static_cast<float>(M_2_SQRTPI * M_SQRT1_2 * 0.5);  // 1 / sqrt(2 pi)

int64_t element_size(c10::ScalarType dtype) {
  return dtype == c10::kFloat ? 4 : 2;
}

// Widens x[i0, i0 + len) into buf and zeroes the rest of its last vector;
// returns the length rounded up to whole vectors.
int64_t widen_block(const void* x, c10::ScalarType dtype, int64_t i0, int64_t len, float* buf) {
  widen(static_cast<const char*>(x) + i0 * element_size(dtype), dtype, buf, len);
  const int64_t padded = (len + FVec::size() - 1) / FVec::size() * FVec::size();
  std::fill(buf + len, buf + padded, 0.f);
  return padded;
}

// Phi(v) = 0.5 * (1 + erf(v / sqrt(2))), with erf by Abramowitz and Stegun
// 7.1.26 (absolute error below 1.5e-7; the formula of ATen's AVX2 float32
// erf), and `gauss` = exp(-v^2 / 2), which that erf needs and phi(v) is a
// multiple of. SLEEF's 1-ulp erff would cost three times the whole GELU.
// The formula gives q = Phi(-|v|) = 0.5 * poly * gauss directly (the 0.5
// folded into the coefficients: exact, the same bits), and the
// lower tail (v < 0) is q itself, never 1 - (1 - q), which would lose q's
// digits to cancellation. (The formula's own relative error there grows with
// |v|, 5e-5 at v = -3 and 1.6e-3 at -5, where |y| < 1.5e-6: below 1e-8 in y.)
// (Always inlined, as the two below: GCC 12 warns of the uninitialized
// placeholder inside its own AVX-512 intrinsics in an out-of-line copy.)
[[gnu::always_inline]] inline FVec normal_cdf(const FVec& v, FVec* gauss) {
  const FVec one(1.f), p(0.3275911f * kAlpha);
  const FVec a1(0.5f * 0.254829592f), a2(0.5f * -0.284496736f), a3(0.5f * 1.421413741f),
      a4(0.5f * -1.453152027f), a5(0.5f * 1.061405429f);
  const FVec t = reciprocal_of(one + p * v.abs());
  const FVec half_poly = ((((a5 * t + a4) * t + a3) * t + a2) * t + a1) * t;
  *gauss = exp_of_nonpositive(v * v * FVec(-0.5f));
  const FVec q = half_poly * *gauss;  // Phi(-|v|)
  return where_less(v, FVec(0.f), q, one - q);
}

[[gnu::always_inline]] inline FVec gelu_of(const FVec& v) {
  FVec gauss;
  return v * normal_cdf(v, &gauss);
}

// dy * GELU'(v) = dy * (Phi(v) + v phi(v)).
[[gnu::always_inline]] inline FVec gelu_backward_of(const FVec& dy, const FVec& v) {
  FVec gauss;
  const FVec cdf = normal_cdf(v, &gauss);
  return dy * (cdf + v * (FVec(kBeta) * gauss));
}

using BVec = Vectorized<c10::BFloat16>;

}  // namespace

// bf16 spans go through registers a vector pair at a time (widened, computed,
// rounded: no buffer), the rest (float16, a bf16 span's last partial vector
// pair) through the float32 buffer; the same vector math either way.
void gelu_span(const void* x, c10::ScalarType dtype, void* y, int64_t n) {
  int64_t done = 0;
  if (dtype == c10::kBFloat16) {
    const auto* xp = static_cast<const c10::BFloat16*>(x);
    auto* yp = static_cast<c10::BFloat16*>(y);
    for (; done + BVec::size() <= n; done += BVec::size()) {
      FVec lo, hi;
      std::tie(lo, hi) = at::vec::convert_bfloat16_float(BVec::loadu(xp + done));
      at::vec::convert_float_bfloat16(gelu_of(lo), gelu_of(hi)).store(yp + done);
    }
  }
  x = static_cast<const char*>(x) + done * element_size(dtype);
  y = static_cast<char*>(y) + done * element_size(dtype);
  n -= done;
  alignas(64) float xb[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t len = std::min(kBlock, n - i0);
    const int64_t padded = widen_block(x, dtype, i0, len, xb);
    for (int64_t i = 0; i < padded; i += FVec::size()) gelu_of(FVec::loadu(xb + i)).store(xb + i);
    narrow(xb, static_cast<char*>(y) + i0 * element_size(dtype), dtype, len);
  }
}

void gelu_backward_span(const void* dy, const void* x, c10::ScalarType dtype, void* dx, int64_t n) {
  int64_t done = 0;
  if (dtype == c10::kBFloat16) {
    const auto* xp = static_cast<const c10::BFloat16*>(x);
    const auto* dyp = static_cast<const c10::BFloat16*>(dy);
    auto* dxp = static_cast<c10::BFloat16*>(dx);
    for (; done + BVec::size() <= n; done += BVec::size()) {
      FVec x0, x1, g0, g1;
      std::tie(x0, x1) = at::vec::convert_bfloat16_float(BVec::loadu(xp + done));
      std::tie(g0, g1) = at::vec::convert_bfloat16_float(BVec::loadu(dyp + done));
      at::vec::convert_float_bfloat16(gelu_backward_of(g0, x0), gelu_backward_of(g1, x1))
          .store(dxp + done);
    }
  }
  const int64_t size = element_size(dtype);
  x = static_cast<const char*>(x) + done * size;
  dy = static_cast<const char*>(dy) + done * size;
  dx = static_cast<char*>(dx) + done * size;
  n -= done;
  alignas(64) float xb[kBlock];
  alignas(64) float gb[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t len = std::min(kBlock, n - i0);
    const int64_t padded = widen_block(x, dtype, i0, len, xb);
    widen_block(dy, dtype, i0, len, gb);
    for (int64_t i = 0; i < padded; i += FVec::size()) {
      gelu_backward_of(FVec::loadu(gb + i), FVec::loadu(xb + i)).store(gb + i);
    }
    narrow(gb, static_cast<char*>(dx) + i0 * element_size(dtype), dtype, len);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
