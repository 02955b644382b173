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
//
// This file holds the heads; the parts are headers of this one translation
// unit, a concept each: the heads' rows and buffers (attention_rows.h), the
// residual codes (attention_residuals.h), the float32 register tile
// (float_tile.h) and the AVX512-BF16 one (bf16_dot_tile.h). Their helpers
// keep the internal linkage (an anonymous namespace) they had in one file,
// so that GCC still specializes the tile products for each caller's
// constant strides: separate files compiled apart would lose that.

#include "attention_kernels.h"
#include "attention_residuals.h"
#include "attention_rows.h"
#include "bf16_dot_tile.h"
#include "float_tile.h"
#include "span_convert.h"
#include "vec_math.h"

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

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

/// Prefetches what backward_heads reads of head h: Q, K, V, dO, O and O's residuals.
inline void prefetch_backward_inputs(const AttentionProblem& p, int64_t h, int64_t size) {
  prefetch_rows(p.q, h, 0, p.t, p.e, size);
  prefetch_rows(p.k, h, 0, p.s, p.e, size);
  prefetch_rows(p.v, h, 0, p.s, p.ev, size);
  prefetch_rows(p.dout, h, 0, p.t, p.ev, size);
  prefetch_rows(p.out, h, 0, p.t, p.ev, size);
  prefetch_rows(p.residual, h, 0, p.t, p.ev, 2);
}

/// D = rowsum(dO * O) of head h's rows into d[t], O the float32 output (out
/// plus its rounding error); dob: dO widened, [t][w.ev]; row: w.ev floats of scratch.
inline void output_grad_dots(const AttentionProblem& p, const Widths& w, int64_t h,
                             const float* dob, float* row, float* d) {
  const int64_t size = element_size(p.dtype);
  for (int64_t r = 0; r < p.t; ++r) {
    widen(row_of(p.out, h, r, size), p.dtype, row, p.ev);
    if (p.residual.data != nullptr) {
      decode_residuals(row, reinterpret_cast<const int16_t*>(row_of(p.residual, h, r, 2)), p.ev,
                       p.dtype);
    }
    std::fill(row + p.ev, row + w.ev, 0.f);
    const float* dor = dob + r * w.ev;
    FVec acc(0.f);
    for (int64_t c = 0; c < w.ev; c += kV) {
      acc = at::vec::fmadd(FVec::loadu(dor + c), FVec::loadu(row + c), acc);
    }
    d[r] = lane_sum(acc);
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
    if (h + 1 < end) prefetch_backward_inputs(p, h + 1, size);
    output_grad_dots(p, w, h, dob.data(), row.data(), d.data());
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
