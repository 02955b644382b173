// ampx::fp8's CUDA kernels (cuda_cast.h): the casts, the amax and the
// scaling updates of an FP8 step, each one launch, with the per-element and
// per-state arithmetic of fp8_math.h, which the CPU paths run too.
//
//   cast_rows       x read once, codes written row-major, amax folded in:
//                   a grid-stride loop over the elements
//   cast_transpose  the same over 32 x 32 tiles, the tile's codes also
//                   written transposed through shared memory, so that a
//                   product gets its column-major operand without a copy
//   amax_kernel     max |x| alone (current scaling reads it before casting)
//   scale_kernel    current scaling's scale and scale_inv, one thread
//   delayed_kernel  one block per delayed-scaling state: window max, scale,
//                   rolled history
// The amax is a max over amax_bits (|x| as unsigned bits): exact, in any
// order, NaN above every number; blocks fold theirs in with atomicMax.

#include "../cuda_cast.h"

#include "../fp8_math.h"

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
namespace fp8 {
namespace detail {
namespace cuda {
namespace {

using math::Format;

constexpr int kThreads = 256;
constexpr int kTile = 32;      // cast_transpose: a 32 x 32 tile per block
constexpr int kTileRows = 8;   // of 32 x 8 threads, 4 rows each

/// The warp's max of v (unsigned), in every lane.
__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
  for (int offset = 16; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  return v;
}

/// Folds each thread's `bits` into *amax (as unsigned bits): one atomic per
/// block. Every thread of the block calls it.
__device__ __forceinline__ void fold_amax(uint32_t bits, uint32_t* amax) {
  __shared__ uint32_t block_max;
  if (threadIdx.x == 0 && threadIdx.y == 0) block_max = 0;
  __syncthreads();
  bits = warp_max(bits);
  if ((threadIdx.x + threadIdx.y * blockDim.x) % 32 == 0) atomicMax(&block_max, bits);
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0 && block_max != 0) atomicMax(amax, block_max);
}

template <class T, Format kFormat>
__global__ void cast_rows(const T* __restrict__ x, int64_t n, const float* __restrict__ scale,
                          uint8_t* __restrict__ codes, uint32_t* amax) {
  const float s = *scale;
  uint32_t bits = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float v = static_cast<float>(x[i]);
    bits = max(bits, math::amax_bits(v));
    codes[i] = math::encode<kFormat>(v * s);
  }
  if (amax != nullptr) fold_amax(bits, amax);
}

template <class T, Format kFormat>
__global__ void cast_transpose(const T* __restrict__ x, int64_t rows, int64_t cols,
                               const float* __restrict__ scale, uint8_t* __restrict__ codes,
                               uint8_t* __restrict__ transposed, uint32_t* amax) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const float s = *scale;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  uint32_t bits = 0;
  for (int k = threadIdx.y; k < kTile; k += kTileRows) {
    const int64_t r = r0 + k, c = c0 + threadIdx.x;
    if (r < rows && c < cols) {
      const float v = static_cast<float>(x[r * cols + c]);
      bits = max(bits, math::amax_bits(v));
      const uint8_t code = math::encode<kFormat>(v * s);
      codes[r * cols + c] = code;
      tile[k][threadIdx.x] = code;
    }
  }
  __syncthreads();
  // Row c of the transposed codes, columns r0.. : the tile read down a column.
  for (int k = threadIdx.y; k < kTile; k += kTileRows) {
    const int64_t c = c0 + k, r = r0 + threadIdx.x;
    if (c < cols && r < rows) transposed[c * rows + r] = tile[threadIdx.x][k];
  }
  if (amax != nullptr) fold_amax(bits, amax);
}

template <class T>
__global__ void amax_kernel(const T* __restrict__ x, int64_t n, uint32_t* amax) {
  uint32_t bits = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    bits = max(bits, math::amax_bits(static_cast<float>(x[i])));
  }
  fold_amax(bits, amax);
}

__global__ void scale_kernel(const float* amax, float fp8_max, float amax_epsilon,
                             bool power_2_scale, float* scale, float* scale_inv) {
  const float s = math::current_scale(*amax, fp8_max, amax_epsilon, power_2_scale);
  *scale = s;
  *scale_inv = 1.0f / s;
}

__global__ void delayed_kernel(const DelayedArgs* states) {
  const DelayedArgs a = states[blockIdx.x];
  const float amax = *a.amax;
  __shared__ float partial[kThreads / 32];
  // The window: entries 1..len-1 of the history, then this step's amax.
  float m = threadIdx.x == 0 ? math::window_max(0.0f, amax) : 0.0f;
  for (int64_t i = 1 + threadIdx.x; i < a.len; i += blockDim.x) m = math::window_max(m, a.history[i]);
  // Non-negative, NaN-free from here: the unsigned max of the bits is the max.
  uint32_t bits = warp_max(math::amax_bits(m));
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = math::amax_of_bits(bits);
  __syncthreads();
  float window = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) window = math::window_max(window, partial[w]);
  if (!math::delayed_seen(amax)) return;  // the same for every thread of the block
  // The history rolled one place, a chunk of the block's width at a time:
  // every read of a chunk before any write of it; later chunks read only
  // entries above.
  for (int64_t base = 0; base < a.len; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const float v = i < a.len ? math::rolled_entry(a.history, a.len, i, amax) : 0.0f;
    __syncthreads();
    if (i < a.len) a.history[i] = v;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const float chosen = a.most_recent ? amax : window;
    const float scale = math::delayed_scale(chosen, a.scaled_max, *a.scale);
    *a.scale = scale;
    *a.scale_inv = 1.0f / scale;
  }
}

// ---- the host side -----------------------------------------------------------

int blocks_for(int64_t n) {
  const int64_t per_sm = 4;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<int>(std::max<int64_t>(1, std::min((n + kThreads - 1) / kThreads, sms * per_sm * 8)));
}

uint32_t* amax_bits_of(const at::Tensor& amax) {
  return amax.defined() ? reinterpret_cast<uint32_t*>(amax.data_ptr<float>()) : nullptr;
}

void check_float_on_cuda(const at::Tensor& x, const char* fn) {
  TORCH_CHECK(x.is_cuda(), "ampx::fp8::", fn, ": x must be a CUDA tensor, got ", x.device());
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, "ampx::fp8::", fn,
              ": x must be float32, bfloat16 or float16, got ", t);
}

void check_one_float(const at::Tensor& t, const at::Tensor& x, const char* fn, const char* what) {
  TORCH_CHECK(t.numel() == 1 && t.scalar_type() == at::kFloat && t.device() == x.device() &&
                  t.is_contiguous(),
              "ampx::fp8::", fn, ": ", what, " must be a float32 tensor of one element on ",
              x.device(), ", got ", t.scalar_type(), " with ", t.numel(), " elements on ",
              t.device());
}

/// Calls fn(T{}, std::integral_constant<Format, F>{}) for x's dtype and `format`.
template <class Fn>
void dispatch(c10::ScalarType dtype, Fp8Format format, Fn&& fn) {
  auto with_format = [&](auto type) {
    if (format == Fp8Format::kE4M3) {
      fn(type, std::integral_constant<Format, Format::kE4M3>{});
    } else {
      fn(type, std::integral_constant<Format, Format::kE5M2>{});
    }
  };
  switch (dtype) {
    case at::kFloat: with_format(float{}); break;
    case at::kBFloat16: with_format(c10::BFloat16{}); break;
    default: with_format(c10::Half{}); break;
  }
}

}  // namespace

bool built() {
  return true;
}

CastOut cast(const at::Tensor& x_in, Fp8Format format, const at::Tensor& scale, bool transpose,
             const at::Tensor& amax) {
  check_float_on_cuda(x_in, "cast");
  check_one_float(scale, x_in, "cast", "scale");
  if (amax.defined()) check_one_float(amax, x_in, "cast", "amax");
  TORCH_CHECK(!transpose || x_in.dim() == 2, "ampx::fp8::cast: a transposed cast takes a 2-D x, got ",
              x_in.sizes());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  CastOut out;
  out.codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  const int64_t n = x.numel();
  if (n == 0) return transpose ? CastOut{out.codes, at::empty({x.size(1), x.size(0)}, out.codes.options())} : out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  uint32_t* amax_bits = amax_bits_of(amax);
  if (transpose) {
    const int64_t rows = x.size(0), cols = x.size(1);
    out.transposed = at::empty({cols, rows}, out.codes.options());
    TORCH_CHECK((rows + kTile - 1) / kTile <= 65535, "ampx::fp8::cast: ", rows,
                " rows are more than a transposed cast takes (65535 x 32)");
    const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile),
                    static_cast<unsigned>((rows + kTile - 1) / kTile));
    const dim3 block(kTile, kTileRows);
    dispatch(x.scalar_type(), format, [&](auto type, auto f) {
      using T = decltype(type);
      cast_transpose<T, decltype(f)::value><<<grid, block, 0, stream>>>(
          reinterpret_cast<const T*>(x.data_ptr()), rows, cols, scale.data_ptr<float>(),
          out.codes.data_ptr<uint8_t>(), out.transposed.data_ptr<uint8_t>(), amax_bits);
    });
  } else {
    dispatch(x.scalar_type(), format, [&](auto type, auto f) {
      using T = decltype(type);
      cast_rows<T, decltype(f)::value><<<blocks_for(n), kThreads, 0, stream>>>(
          reinterpret_cast<const T*>(x.data_ptr()), n, scale.data_ptr<float>(),
          out.codes.data_ptr<uint8_t>(), amax_bits);
    });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor amax(const at::Tensor& x_in) {
  check_float_on_cuda(x_in, "amax");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::zeros({1}, x.options().dtype(at::kFloat));
  const int64_t n = x.numel();
  if (n == 0) return out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch(x.scalar_type(), Fp8Format::kE4M3, [&](auto type, auto) {
    using T = decltype(type);
    amax_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(reinterpret_cast<const T*>(x.data_ptr()),
                                                          n, amax_bits_of(out));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

void current_scale(const at::Tensor& amax, float fp8_max, float amax_epsilon, bool power_2_scale,
                   const at::Tensor& scale, const at::Tensor& scale_inv) {
  check_one_float(amax, amax, "current_scale", "amax");
  check_one_float(scale, amax, "current_scale", "scale");
  check_one_float(scale_inv, amax, "current_scale", "scale_inv");
  const c10::cuda::CUDAGuard guard(amax.device());
  scale_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      amax.data_ptr<float>(), fp8_max, amax_epsilon, power_2_scale, scale.data_ptr<float>(),
      scale_inv.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void delayed_update(const std::vector<DelayedArgs>& states, c10::Device device) {
  if (states.empty()) return;
  TORCH_CHECK(device.is_cuda(), "ampx::fp8::delayed_update: the states must be on a CUDA device, got ",
              device);
  const c10::cuda::CUDAGuard guard(device);
  // The operands through pinned memory: the copy is queued on the stream,
  // the host does not wait (the caching host allocator keeps the buffer
  // until the copy has run).
  const auto bytes = static_cast<int64_t>(states.size() * sizeof(DelayedArgs));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr<uint8_t>(), states.data(), static_cast<size_t>(bytes));
  const at::Tensor on_device = host.to(device, /*non_blocking=*/true);
  delayed_kernel<<<static_cast<unsigned>(states.size()), kThreads, 0,
                   at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const DelayedArgs*>(on_device.data_ptr<uint8_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace detail
}  // namespace fp8
}  // namespace ampx
