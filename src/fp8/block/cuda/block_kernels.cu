// BlockTensor's CUDA kernels (block_cuda.h), with the per-block and
// per-element arithmetic of block_math.h, which the CPU loops run too: a CUDA
// tensor's codes and scales are the CPU's bit for bit.
//
//   quantize_rows     a warp per block of br x bc (bc > 1): the block's amax
//                     (a max over |x| as bits: exact, NaN above every
//                     number), its scale, its codes; grid-stride over blocks
//   quantize_columns  a thread per block of br x 1 (TE's column-wise copy):
//                     neighbouring threads take neighbouring columns, so
//                     every read of a row is coalesced
//   block_values      codes times their block's scale, grid-stride
//   hadamard_rows / hadamard_columns
//                     NVFP4's 16-point transform, a thread per tile of 16
// NVFP4's S_enc is taken on the device from the global amax (the FP8 casts'
// amax kernel, cuda_cast.h): no launch waits for the GPU.

#include "../block_cuda.h"

#include "../../cuda_cast.h"
#include "../../fp8_math.h"
#include "../block_element_code.h"
#include "../block_math.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>

namespace ampx {
namespace fp8 {
namespace detail {
namespace cuda_block {
namespace {

constexpr int kBlockThreads = 256;

/// A 2-D view of the codes and its blocks: rows x cols elements (all but the
/// last dimension folded into rows), blocks of br x bc, nbr x nbc of them
/// (cut short at the ends).
struct Shape {
  int64_t rows, cols, br, bc, nbr, nbc;
};

/// Where the elements' random numbers start: the stream's key and the
/// first element's place in it (element i takes offset + i).
struct Stream {
  uint64_t key, offset;
};

/// An input element as float32, from its bits: exact, and a NaN keeps its
/// sign (what its code keeps) without relying on how the hardware's
/// conversion treats NaNs.
__device__ __forceinline__ float to_float(float v) {
  return v;
}
__device__ __forceinline__ float to_float(c10::BFloat16 v) {
  return ampx::detail::bits_float(static_cast<uint32_t>(v.x) << 16);
}
__device__ __forceinline__ float to_float(c10::Half v) {
  const uint32_t sign = (static_cast<uint32_t>(v.x) & 0x8000u) << 16;
  const uint32_t exponent = (v.x >> 10) & 0x1Fu, mantissa = v.x & 0x3FFu;
  if (exponent == 0x1Fu) return ampx::detail::bits_float(sign | 0x7F800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24, exact
    const float m = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -m : m;
  }
  return ampx::detail::bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

/// The warp's max of v, in every lane.
__device__ __forceinline__ uint32_t warp_max_bits(uint32_t v) {
  for (int offset = 16; offset > 0; offset /= 2) {
    v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  }
  return v;
}

/// A block's amax from the max of its elements' amax_bits: the float, or
/// block_math's NaN when one was NaN (whatever its payload).
__device__ __forceinline__ float amax_of(uint32_t bits) {
  return block_math::block_amax(math::amax_of_bits(bits), bits > 0x7F800000u);
}

/// NVFP4's S_enc from the tensor's amax on the device (null: not NVFP4).
__device__ __forceinline__ float encode_scale(const float* global_amax) {
  return global_amax == nullptr ? 1.0f : block_math::nvfp4_encode_scale(*global_amax);
}

__device__ __forceinline__ void store_scale(void* scales, int64_t b,
                                            const block_math::BlockScale& s, bool fp32_scales) {
  if (fp32_scales) {
    static_cast<float*>(scales)[b] = s.stored_float;
  } else {
    static_cast<uint8_t*>(scales)[b] = s.byte;
  }
}

/// Element i's code: x times the block's factor, rounded to nearest even or
/// by the stream's number for i.
template <bool kStochastic, class Code>
__device__ __forceinline__ uint8_t code_of(const Code& code, float x, float factor,
                                           const Stream& stream, int64_t i) {
  if constexpr (kStochastic) {
    const uint64_t index = stream.offset + static_cast<uint64_t>(i);
    return code.scaled(x, factor, block_math::stream_bits(stream.key, index));
  } else {
    return code.scaled(x, factor);
  }
}

template <class T, class Code, bool kStochastic>
__global__ void quantize_rows(const T* __restrict__ x, Shape sh, block_math::ScaleParams params,
                              const float* global_amax, Code code, Stream stream,
                              bool fp32_scales, uint8_t* __restrict__ codes, void* scales) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const float s_enc = encode_scale(global_amax);
  // Every lane of a warp takes the same blocks: the shuffles see all 32.
  for (int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
       b < sh.nbr * sh.nbc; b += warps) {
    const int64_t r0 = (b / sh.nbc) * sh.br, c0 = (b % sh.nbc) * sh.bc;
    const int64_t w = min(sh.bc, sh.cols - c0), n = min(sh.br, sh.rows - r0) * w;
    uint32_t bits = 0;
    for (int64_t k = lane; k < n; k += 32) {
      const int64_t i = (r0 + k / w) * sh.cols + c0 + k % w;
      bits = max(bits, math::amax_bits(to_float(x[i])));
    }
    const block_math::BlockScale s =
        block_math::block_scale(amax_of(warp_max_bits(bits)), params, s_enc);
    if (lane == 0) store_scale(scales, b, s, fp32_scales);
    for (int64_t k = lane; k < n; k += 32) {
      const int64_t i = (r0 + k / w) * sh.cols + c0 + k % w;
      codes[i] = code_of<kStochastic>(code, to_float(x[i]), s.encode, stream, i);
    }
  }
}

template <class T, class Code, bool kStochastic>
__global__ void quantize_columns(const T* __restrict__ x, Shape sh,
                                 block_math::ScaleParams params, const float* global_amax,
                                 Code code, Stream stream, bool fp32_scales,
                                 uint8_t* __restrict__ codes, void* scales) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const float s_enc = encode_scale(global_amax);
  // Block b = bi * cols + c: rows bi * br.. of column c.
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       b < sh.nbr * sh.cols; b += stride) {
    const int64_t c = b % sh.cols, r0 = (b / sh.cols) * sh.br;
    const int64_t r1 = min(sh.rows, r0 + sh.br);
    uint32_t bits = 0;
    for (int64_t r = r0; r < r1; ++r) {
      bits = max(bits, math::amax_bits(to_float(x[r * sh.cols + c])));
    }
    const block_math::BlockScale s = block_math::block_scale(amax_of(bits), params, s_enc);
    store_scale(scales, b, s, fp32_scales);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = r * sh.cols + c;
      codes[i] = code_of<kStochastic>(code, to_float(x[i]), s.encode, stream, i);
    }
  }
}

__global__ void block_values_kernel(const uint8_t* __restrict__ codes, const void* scales,
                                    bool fp32_scales, ScaleRule rule, Shape sh,
                                    DecodeTable table, float* __restrict__ out) {
  const int64_t n = sh.rows * sh.cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t r = i / sh.cols, c = i % sh.cols;
    const int64_t b = (r / sh.br) * sh.nbc + c / sh.bc;
    const float scale = fp32_scales
                            ? static_cast<const float*>(scales)[b]
                            : block_math::scale_of_byte(static_cast<const uint8_t*>(scales)[b],
                                                        rule);
    out[i] = table.value[codes[i]] * scale;
  }
}

__global__ void hadamard_rows(const float* __restrict__ x, int64_t tiles, bool inverse,
                              float* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < tiles;
       t += stride) {
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = x[t * 16 + i];
    block_math::hadamard16_tile(v, inverse);
#pragma unroll
    for (int i = 0; i < 16; ++i) out[t * 16 + i] = v[i];
  }
}

__global__ void hadamard_columns(const float* __restrict__ x, int64_t bands, int64_t cols,
                                 bool inverse, float* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < bands * cols;
       t += stride) {
    const int64_t first = (t / cols) * 16 * cols + t % cols;  // row band * 16, column
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = x[first + i * cols];
    block_math::hadamard16_tile(v, inverse);
#pragma unroll
    for (int i = 0; i < 16; ++i) out[first + i * cols] = v[i];
  }
}

// ---- the host side -----------------------------------------------------------

/// Blocks of kBlockThreads for `threads` threads of work, at most 32 per SM
/// (the loops stride over the rest).
unsigned grid_for(int64_t threads) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<unsigned>(std::max<int64_t>(
      1, std::min((threads + kBlockThreads - 1) / kBlockThreads, sms * 32)));
}

int64_t blocks_over(int64_t n, int64_t block) {
  return (n + block - 1) / block;
}

Shape shape_of(const at::Tensor& codes, const BlockFormat& format) {
  const int64_t cols = codes.size(-1), rows = cols == 0 ? 0 : codes.numel() / cols;
  const int64_t br = format.block_rows(), bc = format.block_cols();
  return {rows, cols, br, bc, blocks_over(rows, br), blocks_over(cols, bc)};
}

/// Calls fn(T{}) for x's dtype (float32, bfloat16 or float16).
template <class Fn>
void with_dtype(c10::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat:
      return fn(float{});
    case at::kBFloat16:
      return fn(c10::BFloat16{});
    default:
      return fn(c10::Half{});
  }
}

}  // namespace

bool built() {
  return true;
}

BlockTensor quantize(const at::Tensor& x_in, const BlockFormat& format,
                     const c10::optional<StochasticRounding>& stochastic,
                     const c10::optional<float>& given_amax) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const Shape sh = shape_of(x, format);
  const bool fp32_scales =
      format.rule() == ScaleRule::kFloat32 || format.rule() == ScaleRule::kFloat32Pow2;
  auto scale_sizes = x.sizes().vec();
  scale_sizes.back() = sh.nbc;
  if (sh.br > 1) scale_sizes.front() = sh.nbr;
  BlockTensor out;
  out.format = format;
  out.codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  out.scales = at::empty(scale_sizes, x.options().dtype(fp32_scales ? at::kFloat : at::kByte));
  at::Tensor global_amax;
  if (format.rule() == ScaleRule::kNvfp4) {
    // A shard's quantization takes the whole tensor's amax, given on the host.
    global_amax = given_amax ? at::full({1}, *given_amax, x.options().dtype(at::kFloat))
                             : detail::cuda::amax(x);
  }
  if (sh.rows * sh.cols > 0) {
    const cudaStream_t cuda_stream = at::cuda::getCurrentCUDAStream();
    const block_math::ScaleParams params = block_math::scale_params(format);
    const float* amax_ptr = global_amax.defined() ? global_amax.data_ptr<float>() : nullptr;
    const Stream stream{stochastic ? block_math::stream_key(stochastic->seed) : 0,
                        stochastic ? stochastic->offset : 0};
    uint8_t* codes = out.codes.data_ptr<uint8_t>();
    void* scales = out.scales.data_ptr();
    const bool columns = sh.bc == 1;
    const unsigned grid = columns ? grid_for(sh.nbr * sh.cols) : grid_for(sh.nbr * sh.nbc * 32);
    with_dtype(x.scalar_type(), [&](auto type) {
      using T = decltype(type);
      const T* xp = reinterpret_cast<const T*>(x.data_ptr());
      detail::with_element_code(format.element(), [&](auto code) {
        using Code = decltype(code);
        const auto launch = [&](auto stochastic_tag) {
          constexpr bool kStochastic = decltype(stochastic_tag)::value;
          if (columns) {
            quantize_columns<T, Code, kStochastic><<<grid, kBlockThreads, 0, cuda_stream>>>(
                xp, sh, params, amax_ptr, code, stream, fp32_scales, codes, scales);
          } else {
            quantize_rows<T, Code, kStochastic><<<grid, kBlockThreads, 0, cuda_stream>>>(
                xp, sh, params, amax_ptr, code, stream, fp32_scales, codes, scales);
          }
        };
        if (stochastic) {
          launch(std::true_type{});
        } else {
          launch(std::false_type{});
        }
      });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (given_amax) {
    out.global_amax = *given_amax;
  } else if (global_amax.defined()) {
    // BlockTensor keeps the amax as a host float: the one wait, after the
    // launch (the kernel read S_enc on the device).
    const float a = global_amax.item<float>();
    out.global_amax = block_math::block_amax(a, a != a);
  }
  return out;
}

at::Tensor block_values(const BlockTensor& t, const DecodeTable& table) {
  const c10::cuda::CUDAGuard guard(t.codes.device());
  const at::Tensor codes = t.codes.contiguous(), scales = t.scales.contiguous();
  const Shape sh = shape_of(codes, t.format);
  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  if (sh.rows * sh.cols == 0) return out;
  block_values_kernel<<<grid_for(sh.rows * sh.cols), kBlockThreads, 0,
                        at::cuda::getCurrentCUDAStream()>>>(
      codes.data_ptr<uint8_t>(), scales.data_ptr(), scales.scalar_type() == at::kFloat,
      t.format.rule(), sh, table, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor hadamard16(const at::Tensor& x_in, bool inverse, bool columns) {
  TORCH_CHECK(x_in.is_cuda() && x_in.scalar_type() == at::kFloat,
              "ampx::fp8::hadamard16: the kernel takes a float32 CUDA tensor, got ",
              x_in.scalar_type(), " on ", x_in.device());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (columns) {
    const int64_t bands = x.size(0) / 16, cols = x.size(1);
    hadamard_columns<<<grid_for(bands * cols), kBlockThreads, 0, stream>>>(
        x.data_ptr<float>(), bands, cols, inverse, out.data_ptr<float>());
  } else {
    const int64_t tiles = x.numel() / 16;
    hadamard_rows<<<grid_for(tiles), kBlockThreads, 0, stream>>>(x.data_ptr<float>(), tiles,
                                                                   inverse, out.data_ptr<float>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace cuda_block
}  // namespace detail
}  // namespace fp8
}  // namespace ampx
