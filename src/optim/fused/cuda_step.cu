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
// block's scale from its new values (LAMB: its first pass encodes the
// moments and takes its sums from them decoded again; its second pass
// decodes them and writes the weight).
// Each kernel builds its update from the param's FusedParam as the CPU spans
// do (fused_step.h) and runs it element by element through the same
// update_element (optim_math.h). The skip decision is read on the device
// (every kernel returns at once when found_inf != 0), so a step never waits
// for the GPU.

#include "cuda_step.h"

#include "cuda_tiles.cuh"

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

constexpr int64_t kChunk = 1 << 16;  // elements per block

struct Chunk {
  int64_t param;  // index into the launch's DeviceParams
  int64_t begin;  // first element
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

/// This block's chunk as a Span.
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

/// The span through `op`: element by element, or in tiles.
template <class T, class Op>
__device__ __forceinline__ void run_any(const Span& s, const Op& op, const StateMaps& maps,
                                        float* buffers) {
  if (fused_tiled(s.p)) {
    run_tiled<T>(s, op, maps, buffers, /*encode_state=*/true);
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

/// LAMB pass 1: the moments, and this chunk's sums of w^2 and u^2 (a fixed
/// tree over the block: the same bits on every run). Dynamic shared memory:
/// three of the launch's largest tiles of fp32, where any param is tiled.
template <class T>
__global__ void lamb_moments_kernel(Launch l, float* sums) {
  extern __shared__ float buffers[];
  if (skipped(l.found_inf)) return;
  const Span s = span(l);
  ThreadSums acc;
  if (fused_tiled(s.p)) {
    lamb_moments_tiled<T>(s, l.maps, buffers, acc);
  } else {
    run<T>(s, lamb_moments_op(s.p.options, s.at.step, &acc));
  }
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

/// LAMB pass 2: w += -lr * trust ratio * u, u from the moments as stored.
template <class T>
__global__ void lamb_apply_kernel(Launch l, const float* neg_steps) {
  extern __shared__ float buffers[];
  if (skipped(l.found_inf)) return;
  const Span s = span(l);
  const auto op = lamb_apply_op(s.p.options, s.at.step, neg_steps[l.chunks[blockIdx.x].param]);
  if (fused_tiled(s.p)) {
    run_tiled<T>(s, op, l.maps, buffers, /*encode_state=*/false);
  } else {
    run<T>(s, op);
  }
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

/// The dynamic shared memory of params [offset, offset + n)'s kernels:
/// three fp32 tiles of the largest tiled param, if any.
size_t tiles_shared_bytes(const std::vector<DeviceParam>& params, int64_t offset, int64_t n) {
  size_t shared = 0;
  for (int64_t k = offset; k < offset + n; ++k) {
    if (fused_tiled(params[k].p)) {
      shared = std::max(shared, 3 * sizeof(float) * static_cast<size_t>(fused_tile(params[k].p)));
    }
  }
  return shared;
}

/// Lets `kernel` take `shared` bytes of dynamic shared memory (above the
/// default 48 KiB with its static arrays: tiles of 4096 take 48 KiB).
template <class Kernel>
void allow_shared(Kernel* kernel, size_t shared) {
  if (shared == 0) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(shared)));
}

template <class T>
void launch_update(FusedUpdate update, const Launch& l, const std::vector<DeviceParam>& host_params,
                   int64_t param_offset, int64_t n_params, int64_t chunk_offset, int64_t n_chunks,
                   float* neg_steps, cudaStream_t stream, const at::Device& device) {
  if (n_chunks == 0) return;
  const auto grid = static_cast<unsigned>(n_chunks);
  const size_t shared = tiles_shared_bytes(host_params, param_offset, n_params);
  if (update != FusedUpdate::kLamb) {
    allow_shared(update_kernel<T>, shared);
    update_kernel<T><<<grid, kThreads, shared, stream>>>(l);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const auto sums = at::empty({2 * n_chunks}, at::TensorOptions().device(device).dtype(at::kFloat));
  allow_shared(lamb_moments_kernel<T>, shared);
  lamb_moments_kernel<T><<<grid, kThreads, shared, stream>>>(l, sums.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  lamb_ratio_kernel<<<blocks_for(n_params, 128), 128, 0, stream>>>(
      l, param_offset, n_params, chunk_offset, sums.data_ptr<float>(), neg_steps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  allow_shared(lamb_apply_kernel<T>, shared);
  lamb_apply_kernel<T><<<grid, kThreads, shared, stream>>>(l, neg_steps);
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
