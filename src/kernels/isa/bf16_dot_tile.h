#pragma once

// The AVX512-BF16 tile of the attention kernels (attention_span.cpp):
// vdpbf16ps over bf16 operands packed as pairs of elements along the
// reduction, and Bf16DotProduct, WideProduct's product at the bf16 rate for
// Q K^T and dO V^T. Only in the AVX512_BF16 build: a part of
// attention_span.cpp's translation unit (see there), included only by it.

#include "attention_rows.h"
#include "row_blocks.h"

#if defined(CPU_CAPABILITY_AVX512_BF16)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <vector>

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

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
  for_row_blocks<kRows>(
      m, [=](int64_t i, auto rows) __attribute__((always_inline)) {
        dot_micro_tile<decltype(rows)::value>(pairs, a + i * ar, ar, b, ldb, c + i * ldc, ldc,
                                              alpha);
      });
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

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
