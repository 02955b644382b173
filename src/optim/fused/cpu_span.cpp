// The fused optimizer step's CPU spans, compiled once per instruction set
// (cpu_kernels.h). One span = elements [begin, end) of one param; each
// operand is loaded once and stored once:
//   grad  (param dtype)  -> widened to fp32, multiplied by grad_mul
//   weight (fp32 master, or the param widened)
//   exp_avg, exp_avg_sq (fp32)
// The update is built from the param's options as the CUDA kernels build it
// (fused_step.h). bf16 goes through at::vec's bf16 <-> fp32 conversions
// (round to nearest even on the way back); fp16 runs per element (LibTorch
// 1.13 has no Half vectorization). Vector and scalar code evaluate the same
// float expressions in the same order without FMA contraction, so tails
// match vector lanes.
//
// Params with moments in fewer bits (bf16, FP8, 8-bit codes) or a Kahan
// compensated weight run in tiles (run_tiled): a tile's moments and weight
// are decoded into fp32 buffers, the same fp32 loops run over them, and the
// buffers are encoded back (a block format's tile holds whole blocks, each
// block's scale following from its new values). No fp32 copy of a whole moment
// exists at any time.

#include "cpu_kernels.h"

#include "../../kernels/isa/vec_math.h"
#include "state_tiles.h"

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

namespace fused = ::ampx::optim::detail;
using at::vec::Vectorized;
using FVec = Vectorized<float>;
using BVec = Vectorized<c10::BFloat16>;

// One element (the vector loops' tails; fp16 throughout): the shared
// update_element (optim_math.h), as the CUDA kernels run it.
template <class T, class Op>
inline void scalar_element(const FusedParam& p, const FusedAt& at, int64_t i, const Op& op) {
  math::update_element<T>(p, i, at.grad_mul, op, fused::narrow_for<T>(p, at));
}

template <class Op>
void run_float(const FusedParam& p, const FusedAt& at, int64_t begin, int64_t end, const Op& op) {
  float* w_ptr = static_cast<float*>(p.param);
  const float* g_ptr = static_cast<const float*>(p.grad);
  const FVec gm(at.grad_mul);
  int64_t i = begin;
  for (; i + FVec::size() <= end; i += FVec::size()) {
    FVec w = FVec::loadu(w_ptr + i), g(0.f), m(0.f), v(0.f);
    if (Op::kGrad) g = FVec::loadu(g_ptr + i) * gm;
    if (Op::kM) m = FVec::loadu(p.exp_avg + i);
    if (Op::kV) v = FVec::loadu(p.exp_avg_sq + i);
    op(w, g, m, v);
    if (Op::kWriteState) {
      if (Op::kM) m.store(p.exp_avg + i);
      if (Op::kV) v.store(p.exp_avg_sq + i);
    }
    if (Op::kWriteW) w.store(w_ptr + i);
  }
  for (; i < end; ++i) scalar_element<float>(p, at, i, op);
}

template <class Op>
void run_bf16(const FusedParam& p, const FusedAt& at, int64_t begin, int64_t end, const Op& op) {
  constexpr int64_t kF = FVec::size();
  constexpr int64_t kB = BVec::size();  // 2 * kF
  auto* param = static_cast<c10::BFloat16*>(p.param);
  const auto* grad = static_cast<const c10::BFloat16*>(p.grad);
  const auto narrow = fused::narrow_for<c10::BFloat16>(p, at);
  const FVec gm(at.grad_mul);
  int64_t i = begin;
  for (; i + kB <= end; i += kB) {
    FVec g0(0.f), g1(0.f), w0, w1, m0(0.f), m1(0.f), v0(0.f), v1(0.f);
    if (Op::kGrad) {
      std::tie(g0, g1) = at::vec::convert_bfloat16_float(BVec::loadu(grad + i));
      g0 = g0 * gm;
      g1 = g1 * gm;
    }
    if (p.master) {  // bf16 param, fp32 master: the param is write-only
      w0 = FVec::loadu(p.master + i);
      w1 = FVec::loadu(p.master + i + kF);
    } else {
      std::tie(w0, w1) = at::vec::convert_bfloat16_float(BVec::loadu(param + i));
    }
    if (Op::kM) {
      m0 = FVec::loadu(p.exp_avg + i);
      m1 = FVec::loadu(p.exp_avg + i + kF);
    }
    if (Op::kV) {
      v0 = FVec::loadu(p.exp_avg_sq + i);
      v1 = FVec::loadu(p.exp_avg_sq + i + kF);
    }
    op(w0, g0, m0, v0);
    op(w1, g1, m1, v1);
    if (Op::kWriteState) {
      if (Op::kM) {
        m0.store(p.exp_avg + i);
        m1.store(p.exp_avg + i + kF);
      }
      if (Op::kV) {
        v0.store(p.exp_avg_sq + i);
        v1.store(p.exp_avg_sq + i + kF);
      }
    }
    if (Op::kWriteW) {
      if (p.master) {
        w0.store(p.master + i);
        w1.store(p.master + i + kF);
      }
      if (narrow.stochastic) {
        float tmp[kB];
        w0.store(tmp);
        w1.store(tmp + kF);
        CPU_CAPABILITY::bf16_stochastic_weights(tmp, kB, narrow.key, narrow.index_base + i,
                                                reinterpret_cast<uint16_t*>(param + i));
      } else {
        at::vec::convert_float_bfloat16(w0, w1).store(param + i);
      }
    }
  }
  for (; i < end; ++i) scalar_element<c10::BFloat16>(p, at, i, op);
}

template <class Op>
void run(const FusedParam& p, const FusedAt& at, int64_t begin, int64_t end, const Op& op) {
  switch (p.dtype) {
    case fused::FusedDtype::kFloat:
      run_float(p, at, begin, end, op);
      break;
    case fused::FusedDtype::kBFloat16:
      run_bf16(p, at, begin, end, op);
      break;
    case fused::FusedDtype::kHalf:
      for (int64_t i = begin; i < end; ++i) scalar_element<c10::Half>(p, at, i, op);
      break;
  }
}

// LAMB's sums of w^2 and u^2: fp32 lane accumulators over a block, then double.
struct LambSums {
  FVec w{0.f}, u{0.f};
  float sw = 0.f, su = 0.f;
  void add(const FVec& wv, const FVec& uv) {
    w = w + wv * wv;
    u = u + uv * uv;
  }
  void add(float wv, float uv) {
    sw += wv * wv;
    su += uv * uv;
  }
};

// ---- low-bit moments and Kahan weights: tiles ---------------------------------

constexpr int64_t kTileMax = fused::kMaxStateBlock;

/// One tile's fp32 operands.
struct TileBuffers {
  alignas(64) float w[kTileMax];
  alignas(64) float m[kTileMax];
  alignas(64) float v[kTileMax];
};

bool block_format(const FusedParam& p) {
  return p.state_format == fused::FusedState::kFp8 || p.state_format == fused::FusedState::kInt8;
}

/// fused_step.h's fused_tile: a tile holds whole blocks.
int64_t tile_of(const FusedParam& p) {
  return fused::fused_tile(p);
}

/// LAMB's first pass: one block a tile, else 1024 elements, so that its fp32
/// sums run over the elements they always did.
int64_t sums_tile_of(const FusedParam& p) {
  const bool blocks = block_format(p) && (p.exp_avg_codes || p.exp_avg_sq_codes);
  return blocks ? static_cast<int64_t>(p.state_block) : int64_t{1024};
}

/// The coded moments of tile [b, b + n) from q's buffers back into p.
void encode_moments(const FusedParam& p, const FusedAt& at, int64_t b, int64_t n,
                    const FusedParam& q) {
  if (p.exp_avg_codes) CPU_CAPABILITY::encode_moment(p, at.key, 0, b, n, q.exp_avg);
  if (p.exp_avg_sq_codes) CPU_CAPABILITY::encode_moment(p, at.key, 1, b, n, q.exp_avg_sq);
}

/// The coded moments of tile [b, b + n) decoded again into q's buffers.
void decode_moments(const FusedParam& p, int64_t b, int64_t n, const FusedParam& q) {
  if (p.exp_avg_codes) CPU_CAPABILITY::decode_moment(p, 0, b, n, q.exp_avg);
  if (p.exp_avg_sq_codes) CPU_CAPABILITY::decode_moment(p, 1, b, n, q.exp_avg_sq);
}

/// Elements [begin, end) of p in tiles of `tile`: body(q, b, n) runs the fp32 loops on
/// q, elements [0, n) of which are p's [b, b + n), its moments and weight in
/// fp32 buffers. The moments are encoded back after `body` where
/// `encode_state`, the Kahan compensation written where `writes_weight`.
template <class Body>
void run_tiled(const FusedParam& p, const FusedAt& at, int64_t begin, int64_t end, int64_t tile,
               bool encode_state, bool writes_weight, const Body& body) {
  TileBuffers buf;
  TORCH_INTERNAL_ASSERT(tile <= kTileMax && begin % tile == 0);
  const int64_t es = p.dtype == fused::FusedDtype::kFloat ? 4 : 2;
  for (int64_t b = begin; b < end; b += tile) {
    const int64_t n = std::min(tile, end - b);
    FusedParam q = p;
    q.param = static_cast<char*>(p.param) + b * es;
    q.grad = static_cast<const char*>(p.grad) + b * es;
    q.numel = n;
    q.index_base = p.index_base + b;
    q.exp_avg_codes = q.exp_avg_sq_codes = q.compensation = nullptr;
    q.exp_avg_scale = q.exp_avg_sq_scale = nullptr;
    q.state_format = fused::FusedState::kFp32;
    q.master = p.master ? p.master + b : nullptr;
    if (p.compensation) {
      CPU_CAPABILITY::read_kahan_weight(p, b, n, buf.w);
      q.master = buf.w;
    }
    q.exp_avg = p.exp_avg ? p.exp_avg + b : nullptr;
    q.exp_avg_sq = p.exp_avg_sq ? p.exp_avg_sq + b : nullptr;
    if (p.exp_avg_codes) q.exp_avg = buf.m;
    if (p.exp_avg_sq_codes) q.exp_avg_sq = buf.v;
    decode_moments(p, b, n, q);
    body(q, b, n);
    if (encode_state) encode_moments(p, at, b, n, q);
    if (writes_weight && p.compensation) CPU_CAPABILITY::write_compensation(p, b, n, buf.w);
  }
}

/// f(op) with AdamW's or SGD's op, as p.options.update says: built once a
/// span (its scalars take pow), not once a tile.
template <class F>
void with_update_op(const FusedParam& p, const FusedAt& at, const F& f) {
  switch (p.options.update) {
    case fused::FusedUpdate::kAdamW:
      f(fused::adamw_op(p.options, at.step));
      break;
    case fused::FusedUpdate::kSgd:
      if (fused::sgd_has_momentum(p) || p.exp_avg_codes) {  // (a tile's buffer: coded momentum)
        f(fused::sgd_momentum_op(p));
      } else {
        f(fused::sgd_plain_op(p.options));
      }
      break;
    case fused::FusedUpdate::kLamb:
      TORCH_INTERNAL_ASSERT(false, "LAMB runs as lamb_moments_span and lamb_apply_span");
  }
}

}  // namespace

void update_span(const FusedParam& p, const FusedAt& at, int64_t begin, int64_t end) {
  with_update_op(p, at, [&](const auto& op) {
    if (!fused::fused_tiled(p)) {
      run(p, at, begin, end, op);
      return;
    }
    run_tiled(p, at, begin, end, tile_of(p), /*encode_state=*/true, /*writes_weight=*/true,
              [&](const FusedParam& q, int64_t, int64_t n) { run(q, at, 0, n, op); });
  });
}

void lamb_moments_span(const FusedParam& p, const FusedAt& at, int64_t begin, int64_t end,
                       double* sums) {
  // fp32 lane accumulators over at most 4096 elements, then double.
  constexpr int64_t kBlock = 4096;
  const auto add = [sums](const LambSums& acc) {
    sums[0] += lane_sum<double>(acc.w) + acc.sw;
    sums[1] += lane_sum<double>(acc.u) + acc.su;
  };
  if (!fused::fused_tiled(p)) {
    for (int64_t b = begin; b < end; b += kBlock) {
      LambSums acc;
      run(p, at, b, std::min(b + kBlock, end), fused::lamb_moments_op(p.options, at.step, &acc));
      add(acc);
    }
    return;
  }
  // Tiles (at most 4096 elements): the moments, then, where they are coded,
  // their encoding and the sums from the moments as decoded again, so that
  // the trust ratio is that of the update the second pass applies.
  // (The ops built once, not once a tile: their scalars take pow.)
  const bool coded = p.exp_avg_codes || p.exp_avg_sq_codes;
  auto moments = fused::lamb_moments_op<LambSums>(p.options, at.step, nullptr);
  const auto dir = fused::lamb_dir(p.options, at.step);
  run_tiled(p, at, begin, end, sums_tile_of(p), /*encode_state=*/false,
            /*writes_weight=*/false, [&](const FusedParam& q, int64_t b, int64_t n) {
              LambSums acc, unused;
              moments.acc = coded ? &unused : &acc;
              run(q, at, 0, n, moments);
              if (coded) {
                encode_moments(p, at, b, n, q);
                decode_moments(p, b, n, q);
                run(q, at, 0, n, math::LambSumsOp<LambSums>{dir, &acc});
              }
              add(acc);
            });
}

void lamb_apply_span(const FusedParam& p, const FusedAt& at, float neg_step, int64_t begin,
                     int64_t end) {
  const auto op = fused::lamb_apply_op(p.options, at.step, neg_step);
  if (!fused::fused_tiled(p)) {
    run(p, at, begin, end, op);
    return;
  }
  run_tiled(p, at, begin, end, tile_of(p), /*encode_state=*/false, /*writes_weight=*/true,
            [&](const FusedParam& q, int64_t, int64_t n) { run(q, at, 0, n, op); });
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
