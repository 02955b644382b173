#pragma once

// ampx::fp8's CUDA kernels (cuda/cast_kernels.cu, compiled by nvcc where the
// LibTorch found has CUDA), with the arithmetic of fp8_math.h, the CPU
// paths' own:
//   cast            one pass over a 32- or 16-bit tensor: its FP8 codes
//                   row-major and, for a product that wants them, transposed,
//                   with the tensor's amax folded into a device float
//   amax            one reduction (current scaling's, before its cast)
//   current_scale   scale and scale_inv from that amax, on the device
//   delayed_update  the amax histories and scales of any number of
//                   delayed-scaling states in one launch
// Nothing here reads a device value on the host: no launch waits for the GPU.

#include "ampx/fp8/cast.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

namespace ampx {
namespace fp8 {
namespace detail {
namespace cuda {

/// Whether this build has the kernels (false without CUDA: cuda_cast.cpp).
bool built();

/// Whether the kernels take x: this build has them, x is on a CUDA device
/// and float32, bfloat16 or float16 (other dtypes take the ATen paths).
inline bool takes(const at::Tensor& x) {
  const auto t = x.scalar_type();
  return x.is_cuda() && built() && (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf);
}

/// What one cast pass wrote.
struct CastOut {
  at::Tensor codes;       ///< uint8, x's shape
  at::Tensor transposed;  ///< uint8 [cols, rows] (x 2-D, asked for), else undefined
};

/// The codes of x * scale (x float32, bfloat16 or float16 on a CUDA device;
/// scale float32 [1] on it) in one read of x; with `transpose` (x 2-D) also
/// the codes of x^T; with `amax` defined (float32 [1], zero or an earlier
/// amax) max(|x|) folded into it, NaN when x holds one.
CastOut cast(const at::Tensor& x, Fp8Format format, const at::Tensor& scale, bool transpose,
             const at::Tensor& amax);

/// max(|x|) as float32 [1] on x's device, NaN when x holds one; 0 when empty.
at::Tensor amax(const at::Tensor& x);

/// Current scaling's scale of `amax` (fp8_math.h's current_scale) into
/// `scale` and 1 / scale into `scale_inv` (float32 [1] each), on the device.
void current_scale(const at::Tensor& amax, float fp8_max, float amax_epsilon, bool power_2_scale,
                   const at::Tensor& scale, const at::Tensor& scale_inv);

/// One delayed-scaling state's tensors for delayed_update (device pointers).
struct DelayedArgs {
  float* history = nullptr;    ///< [len], TE's layout
  const float* amax = nullptr; ///< [1]: this step's amax
  float* scale = nullptr;      ///< [1]
  float* scale_inv = nullptr;  ///< [1]
  int64_t len = 0;
  float scaled_max = 0;        ///< fp8_max * 2^-margin
  int32_t most_recent = 0;     ///< amax_compute_algo: 1 most_recent, 0 max
  int32_t unused = 0;
};

/// TE's amax_and_scale_update for every state of `states` (all on
/// `device`) in one launch.
void delayed_update(const std::vector<DelayedArgs>& states, c10::Device device);

}  // namespace cuda
}  // namespace detail
}  // namespace fp8
}  // namespace ampx
