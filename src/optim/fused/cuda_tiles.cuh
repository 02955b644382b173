#pragma once

// The fused CUDA step's tiles (cuda_step.cu): a param whose moments are
// coded (bf16, FP8, 8-bit) or whose weight is Kahan-compensated runs as the
// CPU's tiles do (cpu_span.cpp's run_tiled), a thread block decoding a
// tile's moments and weight into shared fp32 buffers, running the fp32
// update on them and encoding them back, each block's scale from its new
// values, with the scalar codecs of state_codes.h. Included by cuda_step.cu
// alone.

#include "fused_step.h"
#include "state_codes.h"

#include <cstdint>

namespace ampx {
namespace optim {
namespace detail {
namespace cuda {

namespace math = ::ampx::detail::math;

constexpr int kThreads = 512;

/// The 8-bit state's maps (signed, unsigned), by value: 2 KiB of the
/// kernels' parameters.
struct StateMaps {
  math::StateMap map[2];
};

/// This block's chunk: elements [begin, end) of param p, at this step.
struct Span {
  const FusedParam& p;
  int64_t begin, end;
  FusedAt at;
};

/// LAMB's sums of w^2 and u^2 over one thread's elements.
struct ThreadSums {
  float w = 0.f, u = 0.f;
  AMPX_HD void add(float wv, float uv) {
    w += wv * wv;
    u += uv * uv;
  }
};

// --- coded moments and Kahan weights: the CPU's tiles in shared memory ------

/// Element i's moment `moment` (0: first, 1: second) of p, decoded.
__device__ __forceinline__ float decoded(const FusedParam& p, const StateMaps& maps, int moment,
                                         int64_t i) {
  const void* codes = moment == 0 ? p.exp_avg_codes : p.exp_avg_sq_codes;
  if (p.state_format == FusedState::kBf16) {
    return math::bf16_state_value(static_cast<const uint16_t*>(codes)[i]);
  }
  const uint8_t code = static_cast<const uint8_t*>(codes)[i];
  const float scale = (moment == 0 ? p.exp_avg_scale : p.exp_avg_sq_scale)[i / p.state_block];
  return p.state_format == FusedState::kFp8 ? math::fp8_state_value(code, scale)
                                            : maps.map[moment].value[code] * scale;
}

/// The largest |x| of x[0, n) over the thread block, NaN where any is NaN
/// (state_span.cpp's absmax_of: on the bits, NaNs' above +inf's).
__device__ inline float block_absmax(const float* x, int64_t n) {
  __shared__ uint32_t partial[kThreads / 32];
  uint32_t acc = 0u;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    acc = max(acc, __float_as_uint(x[k]) & 0x7FFFFFFFu);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    acc = max(acc, __shfl_xor_sync(0xFFFFFFFFu, acc, offset));
  }
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = acc;
  __syncthreads();
  acc = 0u;
  for (int w = 0; w < kThreads / 32; ++w) acc = max(acc, partial[w]);
  __syncthreads();  // partial is read before the next call writes it
  return acc > 0x7F800000u ? __uint_as_float(0x7FC00000u) : __uint_as_float(acc);
}

/// Moment `moment` of tile [b, b + n) of p from the fp32 buffer x back into
/// its codes (state_span.cpp's encode_moment): bf16 rounded stochastically
/// from the moment's stream; FP8 and 8-bit a block at a time, its scale from
/// its new values. Every thread of the block calls it.
__device__ inline void encode_tile(const FusedParam& p, const StateMaps& maps, uint64_t key,
                                   int moment, int64_t b, int64_t n, const float* x) {
  void* codes = moment == 0 ? p.exp_avg_codes : p.exp_avg_sq_codes;
  if (p.state_format == FusedState::kBf16) {
    const uint64_t stream = math::state_key(key, moment);
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
      static_cast<uint16_t*>(codes)[b + k] =
          math::bf16_state_bits(x[k], math::bf16_state_random(stream, p.index_base + b + k));
    }
    return;
  }
  float* scales = moment == 0 ? p.exp_avg_scale : p.exp_avg_sq_scale;
  auto* out = static_cast<uint8_t*>(codes);
  const bool fp8 = p.state_format == FusedState::kFp8;
  for (int64_t o = 0; o < n; o += p.state_block) {
    const int64_t nb = n - o < p.state_block ? n - o : static_cast<int64_t>(p.state_block);
    const float absmax = block_absmax(x + o, nb);
    const float scale = fp8 ? math::fp8_state_scale(absmax) : math::floored_absmax(absmax);
    if (threadIdx.x == 0) scales[(b + o) / p.state_block] = scale;
    for (int64_t k = threadIdx.x; k < nb; k += blockDim.x) {
      const float q = x[o + k] / scale;
      uint32_t code;
      code = fp8 ? math::fp8_state_code(q) : math::map_code(maps.map[moment], q);
      if (moment == 1) code = math::second_moment_floor(code, q);
      out[b + o + k] = static_cast<uint8_t>(code);
    }
  }
}

/// The coded moments of tile [b, b + n) of p decoded into m and v (where
/// coded).
__device__ inline void decode_tile(const FusedParam& p, const StateMaps& maps, int64_t b, int64_t n,
                                   float* m, float* v) {
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    if (p.exp_avg_codes) m[k] = decoded(p, maps, 0, b + k);
    if (p.exp_avg_sq_codes) v[k] = decoded(p, maps, 1, b + k);
  }
}

/// Tile [b, b + n) of p as the update's fp32 operands: its coded moments and
/// Kahan weight decoded into `buffers` (three tiles of `tile` fp32: w, m, v),
/// the rest p's own. Every thread of the block calls it; the buffers are
/// ready when it returns.
template <class T>
__device__ FusedParam load_tile(const FusedParam& p, const StateMaps& maps, int64_t b, int64_t n,
                                int64_t tile, float* buffers) {
  float* w = buffers;
  float* m = buffers + tile;
  float* v = buffers + 2 * tile;
  FusedParam q = p;
  q.param = static_cast<T*>(p.param) + b;
  q.grad = static_cast<const T*>(p.grad) + b;
  q.numel = n;
  q.index_base = p.index_base + b;
  q.exp_avg_codes = q.exp_avg_sq_codes = q.compensation = nullptr;
  q.exp_avg_scale = q.exp_avg_sq_scale = nullptr;
  q.state_format = FusedState::kFp32;
  q.master = p.compensation ? w : (p.master ? p.master + b : nullptr);
  q.exp_avg = p.exp_avg_codes ? m : (p.exp_avg ? p.exp_avg + b : nullptr);
  q.exp_avg_sq = p.exp_avg_sq_codes ? v : (p.exp_avg_sq ? p.exp_avg_sq + b : nullptr);
  if (p.compensation) {  // the Kahan weight: param + compensation, in fp32
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
      w[k] = static_cast<float>(static_cast<const T*>(p.param)[b + k]) +
             static_cast<float>(static_cast<const T*>(p.compensation)[b + k]);
    }
  }
  decode_tile(p, maps, b, n, m, v);
  __syncthreads();
  return q;
}

/// Tile [b, b + n)'s moments from q's buffers back into p's codes.
__device__ inline void store_tile(const FusedParam& p, const StateMaps& maps, uint64_t key,
                                  int64_t b, int64_t n, const FusedParam& q) {
  if (p.exp_avg_codes) encode_tile(p, maps, key, 0, b, n, q.exp_avg);
  if (p.exp_avg_sq_codes) encode_tile(p, maps, key, 1, b, n, q.exp_avg_sq);
}

/// Elements [s.begin, s.end) of s.p in tiles (fused_tile: whole blocks):
/// each tile loaded (load_tile), then body(q, b, n, narrow) with the tile's
/// fp32 operands q of elements [b, b + n) and q's Narrow; the buffers are
/// free again before the next tile's loading.
template <class T, class Body>
__device__ inline void for_tiles(const Span& s, const StateMaps& maps, float* buffers,
                                 const Body& body) {
  const int64_t tile = fused_tile(s.p);
  for (int64_t b = s.begin; b < s.end; b += tile) {
    const int64_t n = s.end - b < tile ? s.end - b : tile;
    const FusedParam q = load_tile<T>(s.p, maps, b, n, tile, buffers);
    body(q, b, n, narrow_for<T>(q, s.at));
    __syncthreads();  // the buffers are read before the next tile's decoding
  }
}

/// The span's elements in tiles through `op`: the fp32 update run on each
/// with the CPU's operands and the compensation written, then, where
/// `encode_state`, its moments encoded back.
template <class T, class Op>
__device__ inline void run_tiled(const Span& s, const Op& op, const StateMaps& maps, float* buffers,
                                 bool encode_state) {
  const FusedParam& p = s.p;
  for_tiles<T>(
      s, maps, buffers, [&](const FusedParam& q, int64_t b, int64_t n, const Narrow<T>& narrow) {
        for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
          math::update_element<T>(q, k, s.at.grad_mul, op, narrow);
          if (p.compensation) {  // what the new param lost, rounded to nearest (its own thread's)
            const float kept = static_cast<float>(static_cast<const T*>(p.param)[b + k]);
            static_cast<T*>(p.compensation)[b + k] = static_cast<T>(q.master[k] - kept);
          }
        }
        __syncthreads();
        if (encode_state) store_tile(p, maps, s.at.key, b, n, q);
      });
}

/// LAMB pass 1 over a tiled param (cpu_span.cpp's lamb_moments_span): each
/// tile's moments, and where they are coded, their encoding, then the sums
/// of w^2 and u^2 from the moments decoded again, so that the trust ratio is
/// that of the update pass 2 applies.
template <class T>
__device__ inline void lamb_moments_tiled(const Span& s, const StateMaps& maps, float* buffers,
                                          ThreadSums& acc) {
  const FusedParam& p = s.p;
  const bool coded = p.exp_avg_codes != nullptr || p.exp_avg_sq_codes != nullptr;
  ThreadSums unused;
  const auto moments = lamb_moments_op(p.options, s.at.step, coded ? &unused : &acc);
  const math::LambSumsOp<ThreadSums> stored{lamb_dir(p.options, s.at.step), &acc};
  for_tiles<T>(s, maps, buffers,
               [&](const FusedParam& q, int64_t b, int64_t n, const Narrow<T>& narrow) {
                 for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
                   math::update_element<T>(q, k, s.at.grad_mul, moments, narrow);
                 }
                 __syncthreads();
                 if (!coded) return;
                 store_tile(p, maps, s.at.key, b, n, q);
                 __syncthreads();  // the codes (global memory) are written before they are read
                 decode_tile(p, maps, b, n, q.exp_avg, q.exp_avg_sq);
                 __syncthreads();
                 for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
                   math::update_element<T>(q, k, s.at.grad_mul, stored, narrow);
                 }
               });
}

}  // namespace cuda
}  // namespace detail
}  // namespace optim
}  // namespace ampx
