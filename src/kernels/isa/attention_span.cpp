// The per-head kernels of ampx's fused scaled dot-product attention, compiled
// once per instruction set (see attention_kernels.h). Flash-attention style:
// the scores are made kBlock x kBlock at a time and never stored whole.
//
// Forward, per block of kBlock query rows: for each block of keys the row can
// see (a causal mask is applied by index: blocks wholly above the diagonal
// are skipped, the diagonal block's upper part set to -inf), the tile of
// scores S = scale * Q K^T, an online softmax (running row maximum m and sum
// l, earlier output rescaled by exp(m_old - m_new)) and O += P V; then
// O / l, rounded once, and the log-sum-exp m + log(l) kept for backward.
//
// Backward, per block of keys: for each block of queries that sees it, P is
// remade from the saved log-sum-exp, then dV += P^T dO, dP = dO V^T,
// dS = P * (dP - D) with D = rowsum(dO * O), dQ += scale dS K and
// dK += scale dS^T Q. dQ collects over key blocks in a float32 buffer; each
// key block's dK and dV are final when its query blocks are done.
//
// Products run in a register-blocked float32 kernel (tile_product) over
// buffers the inputs are widened into once per head, with the second operand
// laid out row-major and padded to whole vector pairs (K and V also
// transposed where the product needs them so). Every sum runs in one fixed
// order, so the bits depend on the build's instruction set only.

#include "attention_kernels.h"
#include "span_convert.h"
#include "vec_math.h"

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kV = FVec::size();
constexpr int64_t kPair = 2 * kV;  // columns per tile_product step
// Query and key rows per tile: a multiple of kPair in every build (16, 16 or
// 32 floats per pair), small enough that the causal diagonal wastes little.
constexpr int64_t kBlock = 32;
static_assert(kBlock % kPair == 0, "tiles hold whole column pairs");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t round_up(int64_t n, int64_t m) {
  return (n + m - 1) / m * m;
}

int64_t element_size(c10::ScalarType dtype) {
  return dtype == c10::kFloat ? 4 : 2;
}

const char* row_of(const AttentionRows& x, int64_t head, int64_t r, int64_t size) {
  return x.data + (x.head[head] + r * x.row) * size;
}
char* mutable_row_of(const AttentionRows& x, int64_t head, int64_t r, int64_t size) {
  return x.data + (x.head[head] + r * x.row) * size;
}

// The residual codes of a row of float32 results `exact` rounded to the
// 16-bit `rounded` (widened back): each difference in units of 2^-15 of the
// rounded value's spacing in its format (at most half a spacing, so |code|
// <= 16384), which makes rounded + code * spacing * 2^-15 within 2^-16
// spacings of exact: for bf16 about one float32 ulp, for fp16 finer. The
// unit, 2^15 / spacing, is a power of two made from the rounded value's
// exponent bits (spacing at least fp16's 2^-24; for bf16 values below 2^-105
// the unit saturates and the residual, under 2^-113, loses precision). A
// non-finite value gets a saturated code and stays non-finite. Branch-free,
// so that the loops vectorize.
inline float unit_of(float rounded, int32_t mantissa_bits, int32_t min_spacing_exponent) {
  uint32_t bits;
  std::memcpy(&bits, &rounded, sizeof bits);
  const int32_t exponent = static_cast<int32_t>((bits >> 23) & 0xffu);  // biased
  const int32_t spacing = std::max(exponent - mantissa_bits, min_spacing_exponent);
  const int32_t unit = std::min(std::max(127 + 15 + 127 - spacing, 1), 254);  // 2^15 / spacing
  const uint32_t unit_bits = static_cast<uint32_t>(unit) << 23;
  float f;
  std::memcpy(&f, &unit_bits, sizeof f);
  return f;
}

int32_t mantissa_bits_of(c10::ScalarType dtype) {
  return dtype == c10::kBFloat16 ? 7 : 10;
}
int32_t min_spacing_exponent_of(c10::ScalarType dtype) {  // biased: bf16 none, fp16 2^-24
  return dtype == c10::kBFloat16 ? 0 : 127 - 24;
}

void encode_residuals(const float* exact, const float* rounded, int16_t* codes, int64_t n,
                      c10::ScalarType dtype) {
  const int32_t mantissa = mantissa_bits_of(dtype), floor = min_spacing_exponent_of(dtype);
  for (int64_t i = 0; i < n; ++i) {
    const float units = (exact[i] - rounded[i]) * unit_of(rounded[i], mantissa, floor);
    codes[i] = static_cast<int16_t>(std::max(-32767.f, std::min(32767.f, std::nearbyint(units))));
  }
}

// rounded[i] += codes[i] / unit: the float32 results back.
void decode_residuals(float* rounded, const int16_t* codes, int64_t n, c10::ScalarType dtype) {
  const int32_t mantissa = mantissa_bits_of(dtype), floor = min_spacing_exponent_of(dtype);
  for (int64_t i = 0; i < n; ++i) {
    rounded[i] += static_cast<float>(codes[i]) / unit_of(rounded[i], mantissa, floor);
  }
}

// c[r][0, kPair) = (accumulate ? c[r] : 0) + alpha * sum_p a(r, p) * b[p][0, kPair)
// for r < R <= 6, where a(r, p) = a[r * ar + p * ap] (any layout: its
// elements are broadcast one at a time) and b's rows are ldb apart. The
// accumulators are named variables, not an array, so that they stay in
// registers (GCC spills an array of vectors to the stack).
template <int R>
void micro_tile(int64_t k, const float* a, int64_t ar, int64_t ap, const float* b, int64_t ldb,
                float* c, int64_t ldc, float alpha, bool accumulate) {
  static_assert(R >= 1 && R <= 6, "six rows at most");
  FVec c00(0.f), c01(0.f), c10(0.f), c11(0.f), c20(0.f), c21(0.f), c30(0.f), c31(0.f), c40(0.f),
      c41(0.f), c50(0.f), c51(0.f);
  for (int64_t p = 0; p < k; ++p) {
    const float* bp = b + p * ldb;
    const FVec b0 = FVec::loadu(bp), b1 = FVec::loadu(bp + kV);
    const float* apr = a + p * ap;
#define AMPX_ROW_FMA(r)                       \
  if constexpr (R > r) {                      \
    const FVec x(apr[r * ar]);                \
    c##r##0 = at::vec::fmadd(x, b0, c##r##0); \
    c##r##1 = at::vec::fmadd(x, b1, c##r##1); \
  }
    AMPX_ROW_FMA(0)
    AMPX_ROW_FMA(1)
    AMPX_ROW_FMA(2)
    AMPX_ROW_FMA(3)
    AMPX_ROW_FMA(4)
    AMPX_ROW_FMA(5)
#undef AMPX_ROW_FMA
  }
  const FVec scale(alpha);
#define AMPX_ROW_STORE(r)                                                  \
  if constexpr (R > r) {                                                   \
    float* cr = c + r * ldc;                                               \
    if (accumulate) {                                                      \
      at::vec::fmadd(scale, c##r##0, FVec::loadu(cr)).store(cr);           \
      at::vec::fmadd(scale, c##r##1, FVec::loadu(cr + kV)).store(cr + kV); \
    } else {                                                               \
      (scale * c##r##0).store(cr);                                         \
      (scale * c##r##1).store(cr + kV);                                    \
    }                                                                      \
  }
  AMPX_ROW_STORE(0)
  AMPX_ROW_STORE(1)
  AMPX_ROW_STORE(2)
  AMPX_ROW_STORE(3)
  AMPX_ROW_STORE(4)
  AMPX_ROW_STORE(5)
#undef AMPX_ROW_STORE
}

// C[m][n] (+)= alpha * A[m][k] B[k][n]; n a multiple of kPair, A as in
// micro_tile, B row-major with rows ldb apart, C row-major with rows ldc apart.
void tile_product(int64_t m, int64_t n, int64_t k, const float* a, int64_t ar, int64_t ap,
                  const float* b, int64_t ldb, float* c, int64_t ldc, float alpha,
                  bool accumulate) {
  constexpr int kRows = 6;  // 12 accumulators, 2 B vectors and a broadcast: 15 of 16 AVX2 registers
  for (int64_t j = 0; j < n; j += kPair) {
    int64_t i = 0;
    for (; i + kRows <= m; i += kRows) {
      micro_tile<kRows>(k, a + i * ar, ar, ap, b + j, ldb, c + i * ldc + j, ldc, alpha, accumulate);
    }
    const float* ai = a + i * ar;
    float* ci = c + i * ldc + j;
    switch (m - i) {
      case 5:
        micro_tile<5>(k, ai, ar, ap, b + j, ldb, ci, ldc, alpha, accumulate);
        break;
      case 4:
        micro_tile<4>(k, ai, ar, ap, b + j, ldb, ci, ldc, alpha, accumulate);
        break;
      case 3:
        micro_tile<3>(k, ai, ar, ap, b + j, ldb, ci, ldc, alpha, accumulate);
        break;
      case 2:
        micro_tile<2>(k, ai, ar, ap, b + j, ldb, ci, ldc, alpha, accumulate);
        break;
      case 1:
        micro_tile<1>(k, ai, ar, ap, b + j, ldb, ci, ldc, alpha, accumulate);
        break;
      default:
        break;
    }
  }
}

// The widths a head's buffers are padded to, and the buffers themselves.
struct Widths {
  int64_t e, ev, s;  // round_up(e, kPair), round_up(ev, kPair), round_up(s, kBlock)
  explicit Widths(const AttentionProblem& p)
      : e(round_up(p.e, kPair)), ev(round_up(p.ev, kPair)), s(round_up(p.s, kBlock)) {}
};

// rows [0, n) of x (width w) -> dst [n][ld], zero-padded to ld columns.
void widen_rows(const AttentionRows& x, c10::ScalarType dtype, int64_t head, int64_t n, int64_t w,
                float* dst, int64_t ld) {
  const int64_t size = element_size(dtype);
  for (int64_t r = 0; r < n; ++r) {
    float* d = dst + r * ld;
    widen(row_of(x, head, r, size), dtype, d, w);
    std::fill(d + w, d + ld, 0.f);
  }
}

// src [n][w] (rows lds apart) -> dst [w][n] (rows ldd apart), in 8 x 8
// blocks that stay in cache.
void transpose(const float* src, int64_t n, int64_t w, int64_t lds, float* dst, int64_t ldd) {
  constexpr int64_t kTile = 8;
  for (int64_t r0 = 0; r0 < n; r0 += kTile) {
    const int64_t r1 = std::min(n, r0 + kTile);
    for (int64_t c0 = 0; c0 < w; c0 += kTile) {
      const int64_t c1 = std::min(w, c0 + kTile);
      for (int64_t c = c0; c < c1; ++c) {
        for (int64_t r = r0; r < r1; ++r) dst[c * ldd + r] = src[r * lds + c];
      }
    }
  }
}

// Scores of query rows [i0, i0 + rows) against keys [j0, j0 + kBlock):
// s = scale * Q K^T, then -inf where a key does not exist or the causal mask
// hides it.
void score_tile(const AttentionProblem& p, const Widths& w, const float* qb, const float* kt,
                int64_t i0, int64_t rows, int64_t j0, float* s) {
  tile_product(rows, kBlock, p.e, qb + i0 * w.e, w.e, 1, kt + j0, w.s, s, kBlock, p.scale, false);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t seen = std::min(p.s, p.causal ? i0 + r + 1 : p.s) - j0;
    seen = std::max<int64_t>(0, std::min(seen, kBlock));
    std::fill(s + r * kBlock + seen, s + (r + 1) * kBlock, kNegInf);
  }
}

}  // namespace

void attention_forward_heads(const AttentionProblem& p, int64_t begin, int64_t end) {
  const Widths w(p);
  const int64_t size = element_size(p.dtype);
  std::vector<float> qb(p.t * w.e), kb(p.s * w.e), kt(p.e * w.s, 0.f), vb(w.s * w.ev, 0.f);
  std::vector<float> s(kBlock * kBlock), o(kBlock * w.ev), row(std::max(w.e, w.ev));
  std::vector<float> m(kBlock), l(kBlock);
  for (int64_t h = begin; h < end; ++h) {
    widen_rows(p.q, p.dtype, h, p.t, p.e, qb.data(), w.e);
    widen_rows(p.k, p.dtype, h, p.s, p.e, kb.data(), w.e);
    transpose(kb.data(), p.s, p.e, w.e, kt.data(), w.s);
    widen_rows(p.v, p.dtype, h, p.s, p.ev, vb.data(), w.ev);
    for (int64_t i0 = 0; i0 < p.t; i0 += kBlock) {
      const int64_t rows = std::min(kBlock, p.t - i0);
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(o.begin(), o.end(), 0.f);
      const int64_t keys = p.causal ? std::min(p.s, i0 + rows) : p.s;
      for (int64_t j0 = 0; j0 < keys; j0 += kBlock) {
        score_tile(p, w, qb.data(), kt.data(), i0, rows, j0, s.data());
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = s.data() + r * kBlock;
          FVec vmax(kNegInf);
          for (int64_t c = 0; c < kBlock; c += kV)
            vmax = at::vec::maximum(vmax, FVec::loadu(sr + c));
          alignas(64) float lanes[kV];
          vmax.store(lanes);
          float m_new = m[r];
          for (int64_t i = 0; i < kV; ++i) m_new = std::max(m_new, lanes[i]);
          // Every row sees key 0 in the first block, so m_new is finite.
          const float rescale = std::exp(m[r] - m_new);
          const FVec shift(m_new);
          FVec sum(0.f);
          for (int64_t c = 0; c < kBlock; c += kV) {
            const FVec e = exp_of(FVec::loadu(sr + c) - shift);
            e.store(sr + c);
            sum = sum + e;
          }
          l[r] = l[r] * rescale + lane_sum(sum);
          m[r] = m_new;
          if (rescale != 1.f) {
            float* orow = o.data() + r * w.ev;
            const FVec f(rescale);
            for (int64_t c = 0; c < w.ev; c += kV) (FVec::loadu(orow + c) * f).store(orow + c);
          }
        }
        tile_product(rows, w.ev, kBlock, s.data(), kBlock, 1, vb.data() + j0 * w.ev, w.ev, o.data(),
                     w.ev, 1.f, true);
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* orow = o.data() + r * w.ev;
        const FVec inv(1.f / l[r]);
        for (int64_t c = 0; c < w.ev; c += kV) (FVec::loadu(orow + c) * inv).store(orow + c);
        char* dst = mutable_row_of(p.out, h, i0 + r, size);
        narrow(orow, dst, p.dtype, p.ev);
        if (p.residual.data != nullptr) {
          widen(dst, p.dtype, row.data(), p.ev);
          encode_residuals(orow, row.data(),
                           reinterpret_cast<int16_t*>(mutable_row_of(p.residual, h, i0 + r, 2)),
                           p.ev, p.dtype);
        }
        p.lse[h * p.t + i0 + r] = m[r] + std::log(l[r]);
      }
    }
  }
}

void attention_backward_heads(const AttentionProblem& p, int64_t begin, int64_t end) {
  const Widths w(p);
  const int64_t size = element_size(p.dtype);
  std::vector<float> qb(p.t * w.e), kb(w.s * w.e, 0.f), kt(p.e * w.s, 0.f), vb(p.s * w.ev),
      vt(p.ev * w.s, 0.f);
  std::vector<float> dob(p.t * w.ev), d(p.t), dq(p.t * w.e);
  std::vector<float> s(kBlock * kBlock), dp(kBlock * kBlock);
  std::vector<float> dk(kBlock * w.e), dv(kBlock * w.ev), row(std::max(w.e, w.ev));
  for (int64_t h = begin; h < end; ++h) {
    widen_rows(p.q, p.dtype, h, p.t, p.e, qb.data(), w.e);
    widen_rows(p.k, p.dtype, h, p.s, p.e, kb.data(), w.e);
    transpose(kb.data(), p.s, p.e, w.e, kt.data(), w.s);
    widen_rows(p.v, p.dtype, h, p.s, p.ev, vb.data(), w.ev);
    transpose(vb.data(), p.s, p.ev, w.ev, vt.data(), w.s);
    widen_rows(p.dout, p.dtype, h, p.t, p.ev, dob.data(), w.ev);
    // D = rowsum(dO * O), O the float32 output (out plus its rounding error).
    for (int64_t r = 0; r < p.t; ++r) {
      widen(row_of(p.out, h, r, size), p.dtype, row.data(), p.ev);
      if (p.residual.data != nullptr) {
        decode_residuals(row.data(), reinterpret_cast<const int16_t*>(row_of(p.residual, h, r, 2)),
                         p.ev, p.dtype);
      }
      std::fill(row.begin() + p.ev, row.begin() + w.ev, 0.f);
      const float* dor = dob.data() + r * w.ev;
      FVec acc(0.f);
      for (int64_t c = 0; c < w.ev; c += kV) {
        acc = at::vec::fmadd(FVec::loadu(dor + c), FVec::loadu(row.data() + c), acc);
      }
      d[r] = lane_sum(acc);
    }
    std::fill(dq.begin(), dq.end(), 0.f);
    const float* lse = p.lse + h * p.t;
    for (int64_t j0 = 0; j0 < p.s; j0 += kBlock) {
      const int64_t cols = std::min(kBlock, p.s - j0);
      std::fill(dk.begin(), dk.end(), 0.f);
      std::fill(dv.begin(), dv.end(), 0.f);
      // Causal: query rows before j0 see none of these keys.
      for (int64_t i0 = p.causal ? j0 / kBlock * kBlock : 0; i0 < p.t; i0 += kBlock) {
        const int64_t rows = std::min(kBlock, p.t - i0);
        score_tile(p, w, qb.data(), kt.data(), i0, rows, j0, s.data());
        for (int64_t r = 0; r < rows; ++r) {  // P = exp(S - lse), masked entries 0
          float* sr = s.data() + r * kBlock;
          const FVec shift(lse[i0 + r]);
          for (int64_t c = 0; c < kBlock; c += kV) {
            exp_of(FVec::loadu(sr + c) - shift).store(sr + c);
          }
        }
        // dV += P^T dO
        tile_product(cols, w.ev, rows, s.data(), 1, kBlock, dob.data() + i0 * w.ev, w.ev, dv.data(),
                     w.ev, 1.f, true);
        // dP = dO V^T, then dS = P * (dP - D) in place of dP
        tile_product(rows, kBlock, p.ev, dob.data() + i0 * w.ev, w.ev, 1, vt.data() + j0, w.s,
                     dp.data(), kBlock, 1.f, false);
        for (int64_t r = 0; r < rows; ++r) {
          float* dpr = dp.data() + r * kBlock;
          const float* pr = s.data() + r * kBlock;
          const FVec dr(d[i0 + r]);
          for (int64_t c = 0; c < kBlock; c += kV) {
            (FVec::loadu(pr + c) * (FVec::loadu(dpr + c) - dr)).store(dpr + c);
          }
        }
        // dQ += scale dS K;  dK += scale dS^T Q
        tile_product(rows, w.e, kBlock, dp.data(), kBlock, 1, kb.data() + j0 * w.e, w.e,
                     dq.data() + i0 * w.e, w.e, p.scale, true);
        tile_product(cols, w.e, rows, dp.data(), 1, kBlock, qb.data() + i0 * w.e, w.e, dk.data(),
                     w.e, p.scale, true);
      }
      for (int64_t c = 0; c < cols; ++c) {
        narrow(dk.data() + c * w.e, mutable_row_of(p.dk, h, j0 + c, size), p.dtype, p.e);
        narrow(dv.data() + c * w.ev, mutable_row_of(p.dv, h, j0 + c, size), p.dtype, p.ev);
      }
    }
    for (int64_t r = 0; r < p.t; ++r) {
      narrow(dq.data() + r * w.e, mutable_row_of(p.dq, h, r, size), p.dtype, p.e);
    }
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
