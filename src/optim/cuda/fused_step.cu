// ampx::optim's fused CUDA step (cuda_step.h): every dense CUDA param of a
// step in one pass over its bytes, a few launches per step whatever the
// number of params:
//   count_steps      one thread per param: step += 1 unless found_inf
//   <update>_kernel  one block per 64K-element chunk of any param: reads the
//                    gradient, the weight (fp32 master or the param) and the
//                    fp32 states once, writes each once, and writes the
//                    16-bit param from the new master in the same pass
//   (LAMB: moments + per-chunk norms, per-param trust ratio, apply)
// The per-element arithmetic and the per-step scalars are those of
// kernels/optim_math.h, which the CPU kernels use too. The skip decision is
// read on the device (every kernel returns at once when found_inf != 0), so
// a step never waits for the GPU.

#include "../cuda_step.h"

#include "../../kernels/optim_math.h"

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
  int64_t tensor;  // index into the launch's TensorArgs
  int64_t begin;   // first element
};

/// What every kernel of a step reads: device pointers.
struct Launch {
  const TensorArgs* args;
  const Chunk* chunks;
  const float* grad_mul;   // or null: 1
  const float* found_inf;  // or null: never skip
  uint64_t seed;
};

__device__ __forceinline__ bool skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.f;
}

__global__ void count_steps(Launch l, int64_t n) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < n && !skipped(l.found_inf)) *l.args[t].step += 1;
}

template <class T>
__device__ __forceinline__ T narrow(float w, const TensorArgs&, uint64_t, int64_t) {
  return static_cast<T>(w);
}
template <>
__device__ __forceinline__ c10::BFloat16 narrow<c10::BFloat16>(float w, const TensorArgs& a,
                                                               uint64_t key, int64_t i) {
  if (!a.stochastic_rounding) return c10::BFloat16(w);
  return c10::BFloat16(math::bf16_bits_stochastic(w, math::sr_bits(key, i)),
                       c10::BFloat16::from_bits());
}

template <class T>
struct Narrow {
  const TensorArgs& a;
  uint64_t key;
  __device__ __forceinline__ T operator()(float w, int64_t i) const {
    return narrow<T>(w, a, key, i);
  }
};

/// Elements [begin, end) of one param through `op` (math::AdamWOp, ...),
/// each by the shared math::update_element, as the CPU kernels' tails.
template <class T, class Op>
__device__ __forceinline__ void run_span(const TensorArgs& a, int64_t begin, int64_t end, float gm,
                                         const Op& op, uint64_t key) {
  const Narrow<T> n{a, key};
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    math::update_element<T>(a, i, gm, op, n);
  }
}

struct Where {
  const TensorArgs& a;
  int64_t begin, end;
  double step;
  float gm;
  uint64_t key;
};

__device__ __forceinline__ Where where(const Launch& l) {
  const Chunk c = l.chunks[blockIdx.x];
  const TensorArgs& a = l.args[c.tensor];
  const double step = *a.step;
  return {a,
          c.begin,
          c.begin + kChunk < a.numel ? c.begin + kChunk : a.numel,
          step,
          l.grad_mul ? *l.grad_mul : 1.f,
          math::sr_key(l.seed, static_cast<int64_t>(step), a.position)};
}

template <class T>
__global__ void adamw_kernel(Launch l) {
  if (skipped(l.found_inf)) return;
  const Where at = where(l);
  const TensorArgs& a = at.a;
  const auto s = math::adamw_scalars(a.lr, a.beta1, a.beta2, a.weight_decay, at.step);
  const math::AdamWOp op{s.decay,
                         static_cast<float>(a.beta1),
                         static_cast<float>(1 - a.beta1),
                         static_cast<float>(a.beta2),
                         static_cast<float>(1 - a.beta2),
                         s.bc2_sqrt,
                         static_cast<float>(a.eps),
                         -s.step_size};
  run_span<T>(a, at.begin, at.end, at.gm, op, at.key);
}

template <class T>
__global__ void sgd_kernel(Launch l) {
  if (skipped(l.found_inf)) return;
  const Where at = where(l);
  const TensorArgs& a = at.a;
  const auto neg_lr = static_cast<float>(-a.lr);
  if (a.exp_avg != nullptr && a.momentum != 0) {
    const math::SgdOp<true> op{static_cast<float>(a.weight_decay),
                               static_cast<float>(a.momentum),
                               static_cast<float>(1 - a.dampening),
                               neg_lr,
                               a.nesterov != 0,
                               at.step == 1};
    run_span<T>(a, at.begin, at.end, at.gm, op, at.key);
  } else {
    const math::SgdOp<false> op{static_cast<float>(a.weight_decay), 0.f, 1.f, neg_lr, false, false};
    run_span<T>(a, at.begin, at.end, at.gm, op, at.key);
  }
}

__device__ __forceinline__ math::LambDir lamb_dir(const TensorArgs& a, double step) {
  const auto s = math::lamb_scalars(a.beta1, a.beta2, step);
  return {s.bc1, s.bc2, static_cast<float>(a.eps), static_cast<float>(a.weight_decay)};
}

/// LAMB pass 1: the moments, and this chunk's sums of w^2 and u^2 (a fixed
/// tree over the block: the same bits on every run).
template <class T>
__global__ void lamb_moments_kernel(Launch l, float* sums) {
  if (skipped(l.found_inf)) return;
  const Where at = where(l);
  const TensorArgs& a = at.a;
  const math::LambDir dir = lamb_dir(a, at.step);
  const auto b1 = static_cast<float>(a.beta1), omb1 = static_cast<float>(1 - a.beta1);
  const auto b2 = static_cast<float>(a.beta2), omb2 = static_cast<float>(1 - a.beta2);
  const T* grad = static_cast<const T*>(a.grad);
  const T* param = static_cast<const T*>(a.param);
  float acc_w = 0.f, acc_u = 0.f;
  for (int64_t i = at.begin + threadIdx.x; i < at.end; i += blockDim.x) {
    const float g = static_cast<float>(grad[i]) * at.gm;
    const float w = a.master ? a.master[i] : static_cast<float>(param[i]);
    float m = a.exp_avg[i], v = a.exp_avg_sq[i];
    math::lamb_moments(g, m, v, b1, omb1, b2, omb2);
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
    const float u = dir(w, m, v);
    acc_w += w * w;
    acc_u += u * u;
  }
  __shared__ float sw[kThreads], su[kThreads];
  sw[threadIdx.x] = acc_w;
  su[threadIdx.x] = acc_u;
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
/// Params [arg_offset, arg_offset + n) of the args; `sums` holds the chunks
/// from chunk_offset on.
__global__ void lamb_ratio_kernel(Launch l, int64_t arg_offset, int64_t n, int64_t chunk_offset,
                                  const float* sums, float* neg_steps) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= n || skipped(l.found_inf)) return;
  const int64_t t = arg_offset + k;
  const TensorArgs& a = l.args[t];
  double w_sq = 0, u_sq = 0;
  for (int64_t c = a.first_chunk; c < a.first_chunk + a.chunks; ++c) {
    w_sq += sums[2 * (c - chunk_offset)];
    u_sq += sums[2 * (c - chunk_offset) + 1];
  }
  neg_steps[t] = static_cast<float>(-(a.lr * math::lamb_trust_ratio(w_sq, u_sq)));
}

template <class T>
__global__ void lamb_apply_kernel(Launch l, const float* neg_steps) {
  if (skipped(l.found_inf)) return;
  const Where at = where(l);
  const math::LambApplyOp op{lamb_dir(at.a, at.step), neg_steps[l.chunks[blockIdx.x].tensor]};
  run_span<T>(at.a, at.begin, at.end, at.gm, op, at.key);
}

int32_t dtype_code(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return 0;
    case c10::kBFloat16:
      return 1;
    case c10::kHalf:
      return 2;
    default:
      TORCH_CHECK(false,
                  "ampx::optim: the fused CUDA step takes Float, BFloat16 and Half "
                  "params, got ",
                  t);
  }
}

unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

/// The update kernels for the params of one dtype: args [arg_offset,
/// arg_offset + n_args), chunks [chunk_offset, chunk_offset + n_chunks);
/// `l.chunks` points at the first of those chunks.
template <class T>
void launch_update(Update update, const Launch& l, int64_t arg_offset, int64_t n_args,
                   int64_t chunk_offset, int64_t n_chunks, float* neg_steps, cudaStream_t stream,
                   const at::Device& device) {
  if (n_chunks == 0) return;
  const auto grid = static_cast<unsigned>(n_chunks);
  switch (update) {
    case Update::kAdamW:
      adamw_kernel<T><<<grid, kThreads, 0, stream>>>(l);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      break;
    case Update::kSgd:
      sgd_kernel<T><<<grid, kThreads, 0, stream>>>(l);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      break;
    case Update::kLamb: {
      const auto sums =
          at::empty({2 * n_chunks}, at::TensorOptions().device(device).dtype(at::kFloat));
      lamb_moments_kernel<T><<<grid, kThreads, 0, stream>>>(l, sums.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      lamb_ratio_kernel<<<blocks_for(n_args, 128), 128, 0, stream>>>(
          l, arg_offset, n_args, chunk_offset, sums.data_ptr<float>(), neg_steps);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      lamb_apply_kernel<T><<<grid, kThreads, 0, stream>>>(l, neg_steps);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      break;
    }
  }
}

}  // namespace

bool built() {
  return true;
}

void fused_step(Update update, const std::vector<TensorArgs>& args,
                const std::vector<c10::ScalarType>& dtypes, c10::Device device,
                const at::Tensor& grad_mul, const at::Tensor& found_inf, uint64_t seed,
                MetaCache& cache) {
  TORCH_INTERNAL_ASSERT(args.size() == dtypes.size());
  if (args.empty()) return;
  TORCH_INTERNAL_ASSERT(!grad_mul.defined() ||
                        (grad_mul.is_cuda() && grad_mul.scalar_type() == at::kFloat));
  TORCH_INTERNAL_ASSERT(!found_inf.defined() ||
                        (found_inf.is_cuda() && found_inf.scalar_type() == at::kFloat));
  // Params grouped by dtype (float, bf16, half), each group a range of the
  // operands and of the chunk table; a chunk is 64K elements of one param.
  std::vector<TensorArgs> sorted;
  std::vector<Chunk> chunks;
  int64_t arg_begin[4] = {0, 0, 0, 0}, chunk_begin[4] = {0, 0, 0, 0};
  for (int32_t code = 0; code < 3; ++code) {
    arg_begin[code] = static_cast<int64_t>(sorted.size());
    chunk_begin[code] = static_cast<int64_t>(chunks.size());
    for (size_t i = 0; i < args.size(); ++i) {
      if (dtype_code(dtypes[i]) != code) continue;
      TensorArgs a = args[i];
      a.first_chunk = static_cast<int64_t>(chunks.size());
      a.chunks = (a.numel + kChunk - 1) / kChunk;
      const auto index = static_cast<int64_t>(sorted.size());
      for (int64_t k = 0; k < a.chunks; ++k) chunks.push_back({index, k * kChunk});
      sorted.push_back(a);
    }
  }
  arg_begin[3] = static_cast<int64_t>(sorted.size());
  chunk_begin[3] = static_cast<int64_t>(chunks.size());

  // Upload the operands only when they differ from the last step's.
  const size_t args_bytes = sorted.size() * sizeof(TensorArgs);
  std::vector<uint8_t> bytes(args_bytes + chunks.size() * sizeof(Chunk));
  std::memcpy(bytes.data(), sorted.data(), args_bytes);
  if (!chunks.empty())
    std::memcpy(bytes.data() + args_bytes, chunks.data(), bytes.size() - args_bytes);
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
  const auto* dev_args = reinterpret_cast<const TensorArgs*>(meta);
  const auto* dev_chunks = reinterpret_cast<const Chunk*>(meta + args_bytes);
  const float* gm = grad_mul.defined() ? grad_mul.data_ptr<float>() : nullptr;
  const float* fi = found_inf.defined() ? found_inf.data_ptr<float>() : nullptr;

  const auto n = static_cast<int64_t>(sorted.size());
  count_steps<<<blocks_for(n, 128), 128, 0, stream>>>(Launch{dev_args, dev_chunks, gm, fi, seed},
                                                      n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // LAMB's per-param step sizes, indexed as the args.
  at::Tensor neg_steps;
  if (update == Update::kLamb) {
    neg_steps = at::empty({n}, at::TensorOptions().device(device).dtype(at::kFloat));
  }
  float* neg_steps_ptr = neg_steps.defined() ? neg_steps.data_ptr<float>() : nullptr;
  for (int32_t code = 0; code < 3; ++code) {
    const Launch l{dev_args, dev_chunks + chunk_begin[code], gm, fi, seed};
    const int64_t a0 = arg_begin[code], na = arg_begin[code + 1] - a0;
    const int64_t c0 = chunk_begin[code], nc = chunk_begin[code + 1] - c0;
    switch (code) {
      case 0:
        launch_update<float>(update, l, a0, na, c0, nc, neg_steps_ptr, stream, device);
        break;
      case 1:
        launch_update<c10::BFloat16>(update, l, a0, na, c0, nc, neg_steps_ptr, stream, device);
        break;
      default:
        launch_update<c10::Half>(update, l, a0, na, c0, nc, neg_steps_ptr, stream, device);
        break;
    }
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace optim
}  // namespace ampx
