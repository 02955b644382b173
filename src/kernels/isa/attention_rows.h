#pragma once

// The rows of one attention head and the float32 buffers they are widened
// into, for the attention kernels compiled once per instruction set
// (attention_span.cpp): the block and tile widths, a row's address, widening
// with zero padding, a cache-blocked transpose, prefetching. A part of
// attention_span.cpp's translation unit (see there), included only by it.

#include "attention_kernels.h"
#include "span_convert.h"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <limits>

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

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
