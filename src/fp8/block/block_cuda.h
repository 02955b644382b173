#pragma once

// BlockTensor's CUDA kernels (cuda/block_kernels.cu, compiled by nvcc where
// the LibTorch found has CUDA), with block_math.h's arithmetic, the CPU
// loops' own, so that a CUDA tensor quantizes to the CPU's codes and scales
// bit for bit:
//   quantize      one launch: each block's amax, scale and codes (a warp per
//                 block along the rows, a thread per block down a column);
//                 NVFP4's global amax by one reduction before it, S_enc
//                 taken from it on the device
//   block_values  codes times their block's scale, float32
//   hadamard16    NVFP4's 16-point transform, the CPU's butterflies
// Only quantize's NVFP4 path reads a device value on the host (the tensor's
// amax into BlockTensor::global_amax, a host float).

#include "ampx/fp8/block.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace ampx {
namespace fp8 {
namespace detail {
namespace cuda_block {

/// Whether this build has the kernels (false without CUDA: block_cuda.cpp).
bool built();

/// The decoding table of an element format: every code's value (codes past
/// the format's width 0), what block_values multiplies by its scales; the
/// CPU's loop and the kernel read the same table.
struct DecodeTable {
  float value[256];
};

/// x (float32, bfloat16 or float16 on a CUDA device) in `format`, as
/// BlockTensor::quantize on the CPU (checked by the caller); NVFP4's
/// global amax given, or x's own.
BlockTensor quantize(const at::Tensor& x, const BlockFormat& format,
                     const c10::optional<StochasticRounding>& stochastic,
                     const c10::optional<float>& global_amax);

/// t's codes times their block's scales, float32, on t's CUDA device.
at::Tensor block_values(const BlockTensor& t, const DecodeTable& table);

/// hadamard16 of a float32 CUDA tensor, along its last dimension, or down
/// the columns of a 2-D one (`columns`).
at::Tensor hadamard16(const at::Tensor& x, bool inverse, bool columns);

}  // namespace cuda_block
}  // namespace detail
}  // namespace fp8
}  // namespace ampx
