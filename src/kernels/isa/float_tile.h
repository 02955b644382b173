#pragma once

// The float32 register tile of the attention kernels (attention_span.cpp):
// C (+)= alpha A B over float32 buffers, row-blocked so that the
// accumulators stay in registers, and WideProduct, the product A B^T of two
// operands' rows widened to float32 that every build runs. A part of
// attention_span.cpp's translation unit (see there), included only by it.

#include "attention_rows.h"
#include "row_blocks.h"
#include "span_convert.h"

#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <vector>

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

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
    for_row_blocks<kRows>(
        m, [=](int64_t i, auto rows) __attribute__((always_inline)) {
          micro_tile<decltype(rows)::value>(k, a + i * ar, ar, ap, b + j, ldb, c + i * ldc + j, ldc,
                                            alpha, accumulate);
        });
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

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
