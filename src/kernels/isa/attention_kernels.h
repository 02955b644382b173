#pragma once

// The per-head kernels of ampx's fused scaled dot-product attention
// (attention_span.cpp), one build per instruction set like the other span
// kernels (see unscale_kernels.h). A call runs heads [begin, end) of a
// problem, each head from start to end on the calling thread, so the bits
// never depend on how heads are split across threads.
//
// Every operand is a set of rows: head h's row r of tensor X starts
// `X.head[h] + r * X.row` elements after `X.data`, and its elements are
// contiguous. The math is float32 throughout (inputs widened once per head,
// products and softmax statistics in float32, one rounding per output); the
// AVX512_BF16 build multiplies bf16 Q K^T and dO V^T with vdpbf16ps, whose
// products of two bf16 values are exact and whose sums are float32.

#include "isa_dispatch.h"

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace ampx {
namespace detail {
namespace cpu {

/// One operand: rows of `dtype` elements (see above).
struct AttentionRows {
  char* data = nullptr;
  const int64_t* head = nullptr;  // element offset of each head's row 0
  int64_t row = 0;                // elements between consecutive rows
};

struct AttentionProblem {
  c10::ScalarType dtype = c10::kFloat;  // q, k, v, out, residual, dout, dq, dk, dv
  int64_t t = 0;                        // query rows
  int64_t s = 0;                        // key and value rows
  int64_t e = 0;                        // query and key width
  int64_t ev = 0;                       // value and output width
  float scale = 1.f;                    // applied to q k^T
  bool causal = false;                  // key j seen by query i only if j <= i
  AttentionRows q, k, v;
  AttentionRows out;
  /// out's rounding error (float32 result minus out) as int16 codes in
  /// units of 2^-15 of out's spacing, as exact as float32; only for 16-bit
  /// dtypes (data null for float32): backward's row sums of dout * out then
  /// see the float32 output, not the rounded one, at 2 bytes per element.
  AttentionRows residual;
  float* lse = nullptr;  // [heads][t]: each query row's log-sum-exp of its scores
  // Backward only: dout in, dq, dk, dv out.
  AttentionRows dout, dq, dk, dv;
};

#define AMPX_DECLARE_ISA_KERNELS(ns)                                                    \
  namespace ns {                                                                        \
  /* out, residual and lse of heads [begin, end). */                                    \
  void attention_forward_heads(const AttentionProblem& p, int64_t begin, int64_t end);  \
  /* dq, dk, dv of heads [begin, end) from q, k, v, out, residual, lse and dout. */     \
  void attention_backward_heads(const AttentionProblem& p, int64_t begin, int64_t end); \
  }
AMPX_DECLARE_ISA_KERNELS(DEFAULT)
AMPX_DECLARE_ISA_KERNELS(AVX2)
AMPX_DECLARE_ISA_KERNELS(AVX512)
AMPX_DECLARE_ISA_KERNELS(AVX512_BF16)
#undef AMPX_DECLARE_ISA_KERNELS

/// The attention kernels of one ISA.
struct AttentionKernels {
  void (*forward)(const AttentionProblem&, int64_t, int64_t);
  void (*backward)(const AttentionProblem&, int64_t, int64_t);
};

#define AMPX_ATTENTION_BUILD(ns)                                \
  AttentionKernels {                                            \
    &ns::attention_forward_heads, &ns::attention_backward_heads \
  }
// (by hand, not AMPX_ISA_DISPATCH: this family has an AVX512_BF16 build)
inline AttentionKernels attention_kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return AMPX_ATTENTION_BUILD(AVX512_BF16);
    case Isa::kAvx512:
      return AMPX_ATTENTION_BUILD(AVX512);
    case Isa::kAvx2:
      return AMPX_ATTENTION_BUILD(AVX2);
    default:
      return AMPX_ATTENTION_BUILD(DEFAULT);
  }
}
#undef AMPX_ATTENTION_BUILD

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
