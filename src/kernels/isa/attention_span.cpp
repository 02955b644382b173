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
// transposed where the product needs them so). In the AVX512_BF16 build, the
// two products whose operands are both bf16 inputs, Q K^T and dO V^T, run
// vdpbf16ps instead (dot_tile_product): Q's and dO's rows stay bf16, K's and
// V's are laid out as pairs of elements along the reduction, transposed, so
// the inner loop is loads and dot products; each product of two bf16 values
// is exact and the sums are float32, as in the wide kernel. (The instruction
// treats bf16 subnormals, below 2^-126, as zero.) P V, P^T dO, dS K and
// dS^T Q multiply float32 P or dS and stay wide; float16 and float32 inputs
// run the wide kernel in every build. Every sum runs in one fixed order, so
// the bits depend on the build's instruction set only.

#include "attention_kernels.h"
#include "span_convert.h"
#include "vec_math.h"

#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512_BF16)
#include <immintrin.h>
#endif

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
template <typename T>
void transpose(const T* src, int64_t n, int64_t w, int64_t lds, T* dst, int64_t ldd) {
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

// The product C = alpha A B^T of one head's rows of two operands (A: t
// rows, B: s rows, both `width` wide), kBlock columns of C at a time: Q K^T
// and dO V^T. This one, every build's: float32 tile products over A widened
// and B widened and transposed.
class WideProduct {
 public:
  WideProduct(int64_t t, int64_t s, int64_t width)
      : width_(width),
        ld_(round_up(width, kPair)),
        ws_(round_up(s, kBlock)),
        a_(t * ld_),
        b_(s * ld_),
        bt_(width * ws_, 0.f) {}

  void load(const AttentionRows& a, const AttentionRows& b, c10::ScalarType dtype, int64_t head,
            int64_t t, int64_t s) {
    widen_rows(a, dtype, head, t, width_, a_.data(), ld_);
    widen_rows(b, dtype, head, s, width_, b_.data(), ld_);
    transpose(b_.data(), s, width_, ld_, bt_.data(), ws_);
  }

  // c[rows][kBlock] = alpha * A[i0, i0 + rows) B[j0, j0 + kBlock)^T (B's rows
  // past s are zeros).
  void tile(int64_t i0, int64_t rows, int64_t j0, float alpha, float* c) const {
    tile_product(rows, kBlock, width_, a_.data() + i0 * ld_, ld_, 1, bt_.data() + j0, ws_, c,
                 kBlock, alpha, false);
  }

 private:
  int64_t width_, ld_, ws_;
  std::vector<float> a_, b_, bt_;
};

#if defined(CPU_CAPABILITY_AVX512_BF16)
constexpr int64_t kLanes = 16;  // float32 lanes of a __m512
static_assert(kBlock == 2 * kLanes, "a dot tile is two vectors of columns wide");

// c[r][0, kBlock) = alpha * sum_p dot(a[r * ar + p], b[p * ldb][0, kBlock))
// for r < R <= 8: each word of a a pair of bf16 (elements 2p and 2p + 1 of
// row r), each row of b kBlock such pairs (column j's elements 2p and
// 2p + 1); vdpbf16ps multiplies the pairs exactly and adds both products to
// the float32 lane. Named accumulators, as in micro_tile.
template <int R>
void dot_micro_tile(int64_t pairs, const uint32_t* a, int64_t ar, const uint32_t* b, int64_t ldb,
                    float* c, int64_t ldc, float alpha) {
  static_assert(R >= 1 && R <= 8, "eight rows at most");
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00,
         c70 = c00, c71 = c00;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t* bp = b + p * ldb;
    const auto b0 = (__m512bh)_mm512_loadu_si512(bp);
    const auto b1 = (__m512bh)_mm512_loadu_si512(bp + kLanes);
    const uint32_t* ap = a + p;
#define AMPX_ROW_DOT(r)                                                       \
  if constexpr (R > r) {                                                      \
    const auto x = (__m512bh)_mm512_set1_epi32(static_cast<int>(ap[r * ar])); \
    c##r##0 = _mm512_dpbf16_ps(c##r##0, x, b0);                               \
    c##r##1 = _mm512_dpbf16_ps(c##r##1, x, b1);                               \
  }
    AMPX_ROW_DOT(0)
    AMPX_ROW_DOT(1)
    AMPX_ROW_DOT(2)
    AMPX_ROW_DOT(3)
    AMPX_ROW_DOT(4)
    AMPX_ROW_DOT(5)
    AMPX_ROW_DOT(6)
    AMPX_ROW_DOT(7)
#undef AMPX_ROW_DOT
  }
  const __m512 scale = _mm512_set1_ps(alpha);
#define AMPX_ROW_STORE(r)                                                  \
  if constexpr (R > r) {                                                   \
    _mm512_storeu_ps(c + r * ldc, _mm512_mul_ps(scale, c##r##0));          \
    _mm512_storeu_ps(c + r * ldc + kLanes, _mm512_mul_ps(scale, c##r##1)); \
  }
  AMPX_ROW_STORE(0)
  AMPX_ROW_STORE(1)
  AMPX_ROW_STORE(2)
  AMPX_ROW_STORE(3)
  AMPX_ROW_STORE(4)
  AMPX_ROW_STORE(5)
  AMPX_ROW_STORE(6)
  AMPX_ROW_STORE(7)
#undef AMPX_ROW_STORE
}

// C[m][kBlock] = alpha * A B over `pairs` pairs, A's rows ar words apart and
// B's pair rows ldb words apart (see dot_micro_tile), C's rows ldc apart.
void dot_tile_product(int64_t m, int64_t pairs, const uint32_t* a, int64_t ar, const uint32_t* b,
                      int64_t ldb, float* c, int64_t ldc, float alpha) {
  constexpr int kRows = 8;  // 16 accumulators, 2 B vectors and a broadcast of 32 registers
  int64_t i = 0;
  for (; i + kRows <= m; i += kRows) {
    dot_micro_tile<kRows>(pairs, a + i * ar, ar, b, ldb, c + i * ldc, ldc, alpha);
  }
  const uint32_t* ai = a + i * ar;
  float* ci = c + i * ldc;
  switch (m - i) {
    case 7:
      dot_micro_tile<7>(pairs, ai, ar, b, ldb, ci, ldc, alpha);
      break;
    case 6:
      dot_micro_tile<6>(pairs, ai, ar, b, ldb, ci, ldc, alpha);
      break;
    case 5:
      dot_micro_tile<5>(pairs, ai, ar, b, ldb, ci, ldc, alpha);
      break;
    case 4:
      dot_micro_tile<4>(pairs, ai, ar, b, ldb, ci, ldc, alpha);
      break;
    case 3:
      dot_micro_tile<3>(pairs, ai, ar, b, ldb, ci, ldc, alpha);
      break;
    case 2:
      dot_micro_tile<2>(pairs, ai, ar, b, ldb, ci, ldc, alpha);
      break;
    case 1:
      dot_micro_tile<1>(pairs, ai, ar, b, ldb, ci, ldc, alpha);
      break;
    default:
      break;
  }
}

// bf16 rows [0, n) of x (width w) -> dst [n][ld] words, each a pair of
// elements (2p, 2p + 1); an odd width's last pair ends in a zero.
void pack_pairs(const AttentionRows& x, int64_t head, int64_t n, int64_t w, uint32_t* dst,
                int64_t ld) {
  for (int64_t r = 0; r < n; ++r) {
    uint32_t* d = dst + r * ld;
    d[ld - 1] = 0;
    std::memcpy(d, row_of(x, head, r, 2), static_cast<size_t>(w) * 2);
  }
}

// WideProduct's product for bf16 operands at the bf16 rate: A's rows as
// pairs, B's as pairs transposed ([pair][column], columns past s zero),
// multiplied by dot_tile_product.
class Bf16DotProduct {
 public:
  Bf16DotProduct(int64_t t, int64_t s, int64_t width)
      : width_(width),
        pairs_((width + 1) / 2),
        ws_(round_up(s, kBlock)),
        a_(t * pairs_),
        b_(s * pairs_),
        bt_(pairs_ * ws_, 0u) {}

  void load(const AttentionRows& a, const AttentionRows& b, c10::ScalarType, int64_t head,
            int64_t t, int64_t s) {
    pack_pairs(a, head, t, width_, a_.data(), pairs_);
    pack_pairs(b, head, s, width_, b_.data(), pairs_);
    transpose(b_.data(), s, pairs_, pairs_, bt_.data(), ws_);
  }

  void tile(int64_t i0, int64_t rows, int64_t j0, float alpha, float* c) const {
    dot_tile_product(rows, pairs_, a_.data() + i0 * pairs_, pairs_, bt_.data() + j0, ws_, c, kBlock,
                     alpha);
  }

 private:
  int64_t width_, pairs_, ws_;
  std::vector<uint32_t> a_, b_, bt_;
};
#endif

// Asks for rows [r0, r1) of head `head` of x (w elements of `size` bytes
// each) to be brought into the cache ahead of use: the next head's inputs
// while this one computes, and the output rows a block will write while it
// computes them. (A model's q, k and v are views of one projection, their
// rows far apart, and the outputs fresh tensors: without this, widening a
// head's rows stalled on their loads, and the stores of a block's output
// rows filled the store buffer and stalled what followed; together a
// quarter of a bf16 head's time.)
void prefetch_rows(const AttentionRows& x, int64_t head, int64_t r0, int64_t r1, int64_t w,
                   int64_t size) {
  if (x.data == nullptr) return;
  for (int64_t r = r0; r < r1; ++r) {
    const char* row = row_of(x, head, r, size);
    for (int64_t b = 0; b < w * size; b += 64) __builtin_prefetch(row + b, 0, 3);
  }
}

// -inf in the scores of query rows [i0, i0 + rows) against keys
// [j0, j0 + kBlock) where a key does not exist or the causal mask hides it.
void mask_scores(const AttentionProblem& p, int64_t i0, int64_t rows, int64_t j0, float* s) {
  for (int64_t r = 0; r < rows; ++r) {
    int64_t seen = std::min(p.s, p.causal ? i0 + r + 1 : p.s) - j0;
    seen = std::max<int64_t>(0, std::min(seen, kBlock));
    std::fill(s + r * kBlock + seen, s + (r + 1) * kBlock, kNegInf);
  }
}

template <class Product>
void forward_heads(const AttentionProblem& p, int64_t begin, int64_t end) {
  const Widths w(p);
  const int64_t size = element_size(p.dtype);
  Product qk(p.t, p.s, p.e);
  std::vector<float> vb(w.s * w.ev, 0.f);
  std::vector<float> s(kBlock * kBlock), o(kBlock * w.ev), row(std::max(w.e, w.ev));
  std::vector<float> m(kBlock), l(kBlock);
  std::vector<char> rounded(w.ev * size);  // one output row in its dtype
  for (int64_t h = begin; h < end; ++h) {
    qk.load(p.q, p.k, p.dtype, h, p.t, p.s);
    widen_rows(p.v, p.dtype, h, p.s, p.ev, vb.data(), w.ev);
    if (h + 1 < end) {
      prefetch_rows(p.q, h + 1, 0, p.t, p.e, size);
      prefetch_rows(p.k, h + 1, 0, p.s, p.e, size);
      prefetch_rows(p.v, h + 1, 0, p.s, p.ev, size);
    }
    for (int64_t i0 = 0; i0 < p.t; i0 += kBlock) {
      const int64_t rows = std::min(kBlock, p.t - i0);
      prefetch_rows(p.out, h, i0, i0 + rows, p.ev, size);
      prefetch_rows(p.residual, h, i0, i0 + rows, p.ev, 2);
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(o.begin(), o.end(), 0.f);
      const int64_t keys = p.causal ? std::min(p.s, i0 + rows) : p.s;
      for (int64_t j0 = 0; j0 < keys; j0 += kBlock) {
        qk.tile(i0, rows, j0, p.scale, s.data());
        mask_scores(p, i0, rows, j0, s.data());
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
        // Rounded into `rounded` first, then copied out: widening the rounded
        // values back from the output row (lines not yet in the cache: a
        // fresh tensor) stalled on those very stores.
        narrow(orow, rounded.data(), p.dtype, p.ev);
        std::memcpy(mutable_row_of(p.out, h, i0 + r, size), rounded.data(),
                    static_cast<size_t>(p.ev * size));
        if (p.residual.data != nullptr) {
          widen(rounded.data(), p.dtype, row.data(), p.ev);
          encode_residuals(orow, row.data(),
                           reinterpret_cast<int16_t*>(mutable_row_of(p.residual, h, i0 + r, 2)),
                           p.ev, p.dtype);
        }
        p.lse[h * p.t + i0 + r] = m[r] + std::log(l[r]);
      }
    }
  }
}

template <class Product>
void backward_heads(const AttentionProblem& p, int64_t begin, int64_t end) {
  const Widths w(p);
  const int64_t size = element_size(p.dtype);
  Product qk(p.t, p.s, p.e), dov(p.t, p.s, p.ev);
  // Q, K (rows past s zero) and dO widened for the products with P and dS.
  std::vector<float> qb(p.t * w.e), kb(w.s * w.e, 0.f), dob(p.t * w.ev), d(p.t), dq(p.t * w.e);
  std::vector<float> s(kBlock * kBlock), dp(kBlock * kBlock);
  std::vector<float> dk(kBlock * w.e), dv(kBlock * w.ev), row(std::max(w.e, w.ev));
  for (int64_t h = begin; h < end; ++h) {
    qk.load(p.q, p.k, p.dtype, h, p.t, p.s);
    dov.load(p.dout, p.v, p.dtype, h, p.t, p.s);
    widen_rows(p.q, p.dtype, h, p.t, p.e, qb.data(), w.e);
    widen_rows(p.k, p.dtype, h, p.s, p.e, kb.data(), w.e);
    widen_rows(p.dout, p.dtype, h, p.t, p.ev, dob.data(), w.ev);
    if (h + 1 < end) {
      prefetch_rows(p.q, h + 1, 0, p.t, p.e, size);
      prefetch_rows(p.k, h + 1, 0, p.s, p.e, size);
      prefetch_rows(p.v, h + 1, 0, p.s, p.ev, size);
      prefetch_rows(p.dout, h + 1, 0, p.t, p.ev, size);
      prefetch_rows(p.out, h + 1, 0, p.t, p.ev, size);
      prefetch_rows(p.residual, h + 1, 0, p.t, p.ev, 2);
    }
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
      prefetch_rows(p.dk, h, j0, j0 + cols, p.e, size);
      prefetch_rows(p.dv, h, j0, j0 + cols, p.ev, size);
      if (j0 + kBlock >= p.s) prefetch_rows(p.dq, h, 0, p.t, p.e, size);  // written last
      std::fill(dk.begin(), dk.end(), 0.f);
      std::fill(dv.begin(), dv.end(), 0.f);
      // Causal: query rows before j0 see none of these keys.
      for (int64_t i0 = p.causal ? j0 / kBlock * kBlock : 0; i0 < p.t; i0 += kBlock) {
        const int64_t rows = std::min(kBlock, p.t - i0);
        qk.tile(i0, rows, j0, p.scale, s.data());
        mask_scores(p, i0, rows, j0, s.data());
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
        dov.tile(i0, rows, j0, 1.f, dp.data());
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

}  // namespace

void attention_forward_heads(const AttentionProblem& p, int64_t begin, int64_t end) {
#if defined(CPU_CAPABILITY_AVX512_BF16)
  if (p.dtype == c10::kBFloat16) return forward_heads<Bf16DotProduct>(p, begin, end);
#endif
  forward_heads<WideProduct>(p, begin, end);
}

void attention_backward_heads(const AttentionProblem& p, int64_t begin, int64_t end) {
#if defined(CPU_CAPABILITY_AVX512_BF16)
  if (p.dtype == c10::kBFloat16) return backward_heads<Bf16DotProduct>(p, begin, end);
#endif
  backward_heads<WideProduct>(p, begin, end);
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
