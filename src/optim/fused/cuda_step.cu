// The fused step on CUDA (cuda_step.h): every dense CUDA param of a step in
// one pass over its bytes, a few launches per step whatever the number of
// params:
//   count_steps      one thread per param: step += 1 unless found_inf
//   update_kernel    one block per 64K-element chunk of any param: reads the
//                    gradient, the weight (fp32 master or the param) and the
//                    fp32 states once, writes each once, and writes the
//                    16-bit param from the new master in the same pass
//   (LAMB: moments + per-chunk norms, per-param trust ratio, apply)
// A param whose moments are coded (bf16, FP8 or 8-bit state) or whose weight
// is Kahan-compensated runs in the CPU's tiles (cpu_span.cpp's run_tiled):
// a thread block decodes a tile's moments and weight into shared fp32
// buffers, runs the same fp32 update on them, and encodes them back, each
// block's scale from its new values (AdamW and SGD; the driver refuses LAMB).
// Each kernel builds its update from the param's FusedParam as the CPU spans
// do (fused_step.h) and runs it element by element through the same
// update_element (optim_math.h). The skip decision is read on the device
// (every kernel returns at once when found_inf != 0), so a step never waits
// for the GPU.

#include "cuda_step.h"

#include "state_codes.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>

namespace ampx {
namespace optim {
namespace detail {
namespace cuda {
namespace {

namespace math = ::ampx::detail::math;

constexpr int64_t kChunk = 1 << 16;  // elements per block
constexpr int kThreads = 512;

struct Chunk {
  int64_t param;  // index into the launch's DeviceParams
  int64_t begin;  // first element
};

/// The 8-bit state's maps (signed, unsigned), by value: 2 KiB of the
/// kernels' parameters.
struct StateMaps {
  math::StateMap map[2];
};

/// What every kernel of a step reads: device pointers.
struct Launch {
  const DeviceParam* params;
  const Chunk* chunks;
  const float* grad_mul;   // or null: 1
  const float* found_inf;  // or null: never skip
  uint64_t seed;
  StateMaps maps;
};

__device__ __forceinline__ bool skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.f;
}

__global__ void count_steps(Launch l, int64_t n) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < n && !skipped(l.found_inf)) *l.params[t].step += 1;
}

/// This block's chunk: elements [begin, end) of param p, at this step.
struct Span {
  const FusedParam& p;
  int64_t begin, end;
  FusedAt at;
};

__device__ __forceinline__ Span span(const Launch& l) {
  const Chunk c = l.chunks[blockIdx.x];
  const DeviceParam& d = l.params[c.param];
  return {d.p, c.begin, c.begin + kChunk < d.p.numel ? c.begin + kChunk : d.p.numel,
          fused_at(d.p, *d.step, l.grad_mul ? *l.grad_mul : 1.f, l.seed)};
}

/// The span's elements through `op`, each by the shared update_element, as
/// the CPU spans' tails.
template <class T, class Op>
__device__ __forceinline__ void run(const Span& s, const Op& op) {
  const Narrow<T> narrow = narrow_for<T>(s.p, s.at);
  for (int64_t i = s.begin + threadIdx.x; i < s.end; i += blockDim.x) {
    math::update_element<T>(s.p, i, s.at.grad_mul, op, narrow);
  }
}

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
__device__ float block_absmax(const float* x, int64_t n) {
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
__device__ void encode_tile(const FusedParam& p, const StateMaps& maps, uint64_t key, int moment,
                            int64_t b, int64_t n, const float* x) {
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
      if (fp8) {
        code = math::fp8_state_code(q);
        // A positive second moment keeps at least the smallest subnormal's code.
        if (moment == 1 && q > 0.f && code == 0u) code = 1u;
      } else {
        code = math::map_code(maps.map[moment], q);
      }
      out[b + o + k] = static_cast<uint8_t>(code);
    }
  }
}

/// The span's elements in tiles (fused_tile: whole blocks), through `op`:
/// each tile's coded moments and Kahan weight decoded into `buffers` (three
/// tiles of fp32, shared), the fp32 update run on them with the CPU's
/// operands, then encoded back and the compensation written.
template <class T, class Op>
__device__ void run_tiled(const Span& s, const Op& op, const StateMaps& maps, float* buffers) {
  const FusedParam& p = s.p;
  const int64_t tile = fused_tile(p);
  float* w = buffers;
  float* m = buffers + tile;
  float* v = buffers + 2 * tile;
  for (int64_t b = s.begin; b < s.end; b += tile) {
    const int64_t n = s.end - b < tile ? s.end - b : tile;
    FusedParam q = p;
    q.param = static_cast<T*>(p.param) + b;
    q.grad = static_cast<const T*>(p.grad) + b;
    q.numel = n;
    q.index_base = p.index_base + b;
    q.exp_avg_codes = q.exp_avg_sq_codes = q.compensation = nullptr;
    q.exp_avg_scale = q.exp_avg_sq_scale = nullptr;
    q.state_format = FusedState::kFp32;
    q.master = p.master ? p.master + b : nullptr;
    q.exp_avg = p.exp_avg_codes ? m : (p.exp_avg ? p.exp_avg + b : nullptr);
    q.exp_avg_sq = p.exp_avg_sq_codes ? v : (p.exp_avg_sq ? p.exp_avg_sq + b : nullptr);
    if (p.compensation) q.master = w;
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
      if (p.compensation) {  // the Kahan weight: param + compensation, in fp32
        w[k] = static_cast<float>(static_cast<const T*>(p.param)[b + k]) +
               static_cast<float>(static_cast<const T*>(p.compensation)[b + k]);
      }
      if (p.exp_avg_codes) m[k] = decoded(p, maps, 0, b + k);
      if (p.exp_avg_sq_codes) v[k] = decoded(p, maps, 1, b + k);
    }
    __syncthreads();
    const Narrow<T> narrow = narrow_for<T>(q, s.at);
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
      math::update_element<T>(q, k, s.at.grad_mul, op, narrow);
      if (p.compensation) {  // what the new param lost, rounded to nearest (its own thread's)
        const float kept = static_cast<float>(static_cast<const T*>(p.param)[b + k]);
        static_cast<T*>(p.compensation)[b + k] = static_cast<T>(w[k] - kept);
      }
    }
    __syncthreads();
    if (p.exp_avg_codes) encode_tile(p, maps, s.at.key, 0, b, n, m);
    if (p.exp_avg_sq_codes) encode_tile(p, maps, s.at.key, 1, b, n, v);
    __syncthreads();  // the buffers are read before the next tile's decoding
  }
}

/// The span through `op`: element by element, or in tiles.
template <class T, class Op>
__device__ __forceinline__ void run_any(const Span& s, const Op& op, const StateMaps& maps,
                                        float* buffers) {
  if (fused_tiled(s.p)) {
    run_tiled<T>(s, op, maps, buffers);
  } else {
    run<T>(s, op);
  }
}

/// AdamW or SGD, as the params' options say (the same update for all).
/// Dynamic shared memory: three of the launch's largest tiles of fp32.
template <class T>
__global__ void update_kernel(Launch l) {
  extern __shared__ float buffers[];
  if (skipped(l.found_inf)) return;
  const Span s = span(l);
  const FusedOptions& o = s.p.options;
  switch (o.update) {
    case FusedUpdate::kAdamW:
      run_any<T>(s, adamw_op(o, s.at.step), l.maps, buffers);
      break;
    case FusedUpdate::kSgd:
      if (sgd_has_momentum(s.p) || s.p.exp_avg_codes) {  // (a tile's buffer: coded momentum)
        run_any<T>(s, sgd_momentum_op(s.p), l.maps, buffers);
      } else {
        run_any<T>(s, sgd_plain_op(o), l.maps, buffers);
      }
      break;
    case FusedUpdate::kLamb:
      break;  // lamb_moments_kernel and lamb_apply_kernel
  }
}

/// LAMB's sums of w^2 and u^2 over one thread's elements.
struct ThreadSums {
  float w = 0.f, u = 0.f;
  AMPX_HD void add(float wv, float uv) {
    w += wv * wv;
    u += uv * uv;
  }
};

/// LAMB pass 1: the moments, and this chunk's sums of w^2 and u^2 (a fixed
/// tree over the block: the same bits on every run).
template <class T>
__global__ void lamb_moments_kernel(Launch l, float* sums) {
  if (skipped(l.found_inf)) return;
  const Span s = span(l);
  ThreadSums acc;
  run<T>(s, lamb_moments_op(s.p.options, s.at.step, &acc));
  __shared__ float sw[kThreads], su[kThreads];
  sw[threadIdx.x] = acc.w;
  su[threadIdx.x] = acc.u;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) {
      sw[threadIdx.x] += sw[threadIdx.x + half];
      su[threadIdx.x] += su[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    sums[2 * blockIdx.x] = sw[0];
    sums[2 * blockIdx.x + 1] = su[0];
  }
}

/// LAMB: each param's -lr * trust ratio, its chunks' sums added in order.
/// Params [param_offset, param_offset + n) of the launch; `sums` holds the
/// chunks from chunk_offset on.
__global__ void lamb_ratio_kernel(Launch l, int64_t param_offset, int64_t n, int64_t chunk_offset,
                                  const float* sums, float* neg_steps) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= n || skipped(l.found_inf)) return;
  const int64_t t = param_offset + k;
  const DeviceParam& d = l.params[t];
  double w_sq = 0, u_sq = 0;
  for (int64_t c = d.first_chunk; c < d.first_chunk + d.chunks; ++c) {
    w_sq += sums[2 * (c - chunk_offset)];
    u_sq += sums[2 * (c - chunk_offset) + 1];
  }
  neg_steps[t] = lamb_neg_step(d.p.options, w_sq, u_sq);
}

template <class T>
__global__ void lamb_apply_kernel(Launch l, const float* neg_steps) {
  if (skipped(l.found_inf)) return;
  const Span s = span(l);
  run<T>(s, lamb_apply_op(s.p.options, s.at.step, neg_steps[l.chunks[blockIdx.x].param]));
}

unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

/// The update kernels for the params of one dtype: params [param_offset,
/// param_offset + n_params), chunks [chunk_offset, chunk_offset + n_chunks);
/// `l.chunks` points at the first of those chunks.
/// The 8-bit maps, from the host's tables.
StateMaps state_maps() {
  StateMaps maps;
  for (const int m : {0, 1}) maps.map[m] = math::dynamic_map(m == 0);
  return maps;
}

/// Whether none of params [offset, offset + n) runs in tiles.
bool shared_free(const std::vector<DeviceParam>& params, int64_t offset, int64_t n) {
  for (int64_t k = offset; k < offset + n; ++k) {
    if (fused_tiled(params[k].p)) return false;
  }
  return true;
}

template <class T>
void launch_update(FusedUpdate update, const Launch& l, const std::vector<DeviceParam>& host_params,
                   int64_t param_offset, int64_t n_params, int64_t chunk_offset, int64_t n_chunks,
                   float* neg_steps, cudaStream_t stream, const at::Device& device) {
  if (n_chunks == 0) return;
  const auto grid = static_cast<unsigned>(n_chunks);
  if (update != FusedUpdate::kLamb) {
    size_t shared = 0;  // three fp32 tiles of the largest tiled param, if any
    for (int64_t k = param_offset; k < param_offset + n_params; ++k) {
      if (fused_tiled(host_params[k].p)) {
        shared =
            std::max(shared, 3 * sizeof(float) * static_cast<size_t>(fused_tile(host_params[k].p)));
      }
    }
    if (shared > 0) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(
          update_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
    }
    update_kernel<T><<<grid, kThreads, shared, stream>>>(l);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  TORCH_INTERNAL_ASSERT(shared_free(host_params, param_offset, n_params),
                        "ampx::optim: LAMB's CUDA step takes fp32 moments and no Kahan weights");
  const auto sums = at::empty({2 * n_chunks}, at::TensorOptions().device(device).dtype(at::kFloat));
  lamb_moments_kernel<T><<<grid, kThreads, 0, stream>>>(l, sums.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  lamb_ratio_kernel<<<blocks_for(n_params, 128), 128, 0, stream>>>(
      l, param_offset, n_params, chunk_offset, sums.data_ptr<float>(), neg_steps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  lamb_apply_kernel<T><<<grid, kThreads, 0, stream>>>(l, neg_steps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

/// launch_update for the params of dtype `dtype` (its ranges as there).
void launch_for_dtype(FusedDtype dtype, FusedUpdate update, const Launch& l,
                      const std::vector<DeviceParam>& params, int64_t p0, int64_t np, int64_t c0,
                      int64_t nc, float* neg_steps, cudaStream_t stream, const at::Device& device) {
  switch (dtype) {
    case FusedDtype::kFloat:
      launch_update<float>(update, l, params, p0, np, c0, nc, neg_steps, stream, device);
      break;
    case FusedDtype::kBFloat16:
      launch_update<c10::BFloat16>(update, l, params, p0, np, c0, nc, neg_steps, stream, device);
      break;
    case FusedDtype::kHalf:
      launch_update<c10::Half>(update, l, params, p0, np, c0, nc, neg_steps, stream, device);
      break;
  }
}

}  // namespace

bool built() {
  return true;
}

void fused_step(const std::vector<DeviceParam>& params, c10::Device device,
                const at::Tensor& grad_mul, const at::Tensor& found_inf, uint64_t seed,
                MetaCache& cache) {
  if (params.empty()) return;
  const FusedUpdate update = params[0].p.options.update;
  TORCH_INTERNAL_ASSERT(!grad_mul.defined() ||
                        (grad_mul.is_cuda() && grad_mul.scalar_type() == at::kFloat));
  TORCH_INTERNAL_ASSERT(!found_inf.defined() ||
                        (found_inf.is_cuda() && found_inf.scalar_type() == at::kFloat));
  // Params grouped by dtype (float, bf16, half), each group a range of the
  // params and of the chunk table; a chunk is 64K elements of one param.
  std::vector<DeviceParam> sorted;
  std::vector<Chunk> chunks;
  int64_t param_begin[kFusedDtypes + 1] = {}, chunk_begin[kFusedDtypes + 1] = {};
  for (int code = 0; code < kFusedDtypes; ++code) {
    param_begin[code] = static_cast<int64_t>(sorted.size());
    chunk_begin[code] = static_cast<int64_t>(chunks.size());
    for (const auto& param : params) {
      TORCH_INTERNAL_ASSERT(param.p.options.update == update);
      if (static_cast<int>(param.p.dtype) != code) continue;
      DeviceParam d = param;
      d.first_chunk = static_cast<int64_t>(chunks.size());
      d.chunks = (d.p.numel + kChunk - 1) / kChunk;
      const auto index = static_cast<int64_t>(sorted.size());
      for (int64_t k = 0; k < d.chunks; ++k) chunks.push_back({index, k * kChunk});
      sorted.push_back(d);
    }
  }
  param_begin[kFusedDtypes] = static_cast<int64_t>(sorted.size());
  chunk_begin[kFusedDtypes] = static_cast<int64_t>(chunks.size());

  // Upload the operands only when they differ from the last step's.
  const size_t params_bytes = sorted.size() * sizeof(DeviceParam);
  std::vector<uint8_t> bytes(params_bytes + chunks.size() * sizeof(Chunk));
  std::memcpy(bytes.data(), sorted.data(), params_bytes);
  if (!chunks.empty())
    std::memcpy(bytes.data() + params_bytes, chunks.data(), bytes.size() - params_bytes);
  auto& cached = cache.by_device[device.index()];
  if (bytes != cached.bytes || !cached.device.defined()) {
    auto host =
        at::empty({static_cast<int64_t>(bytes.size())}, at::TensorOptions().dtype(at::kByte))
            .pin_memory();
    std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
    cached.device = host.to(device, /*non_blocking=*/true);
    cached.host = host;
    cached.bytes = std::move(bytes);
  }
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
  const auto* meta = static_cast<const uint8_t*>(cached.device.data_ptr());
  const auto* dev_params = reinterpret_cast<const DeviceParam*>(meta);
  const auto* dev_chunks = reinterpret_cast<const Chunk*>(meta + params_bytes);
  const float* gm = grad_mul.defined() ? grad_mul.data_ptr<float>() : nullptr;
  const float* fi = found_inf.defined() ? found_inf.data_ptr<float>() : nullptr;

  const StateMaps maps = state_maps();
  const auto n = static_cast<int64_t>(sorted.size());
  count_steps<<<blocks_for(n, 128), 128, 0, stream>>>(
      Launch{dev_params, dev_chunks, gm, fi, seed, maps}, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // LAMB's per-param step sizes, indexed as the params.
  const at::Tensor neg_steps =
      update == FusedUpdate::kLamb
          ? at::empty({n}, at::TensorOptions().device(device).dtype(at::kFloat))
          : at::Tensor();
  float* neg_steps_ptr = neg_steps.defined() ? neg_steps.data_ptr<float>() : nullptr;
  for (int code = 0; code < kFusedDtypes; ++code) {
    const Launch l{dev_params, dev_chunks + chunk_begin[code], gm, fi, seed, maps};
    const int64_t p0 = param_begin[code], np = param_begin[code + 1] - p0;
    const int64_t c0 = chunk_begin[code], nc = chunk_begin[code + 1] - c0;
    launch_for_dtype(static_cast<FusedDtype>(code), update, l, sorted, p0, np, c0, nc,
                     neg_steps_ptr, stream, device);
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace optim
}  // namespace ampx
