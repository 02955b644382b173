#pragma once

// AMPX_HD marks the arithmetic that both devices run: the CPU kernels and
// the CUDA kernels include the same functions, so that the CPU tests check
// what the GPU computes (optim/fused/optim_math.h for the optimizers,
// fp8/fp8_math.h for the FP8 casts and scales).

#include <bit>
#include <cstdint>

#if defined(__CUDACC__)
#define AMPX_HD __host__ __device__ __forceinline__
#else
#define AMPX_HD inline
#endif

namespace ampx {
namespace detail {

/// The bits of a float32, on either device.
AMPX_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<uint32_t>(f);
#endif
}

/// The float32 of `bits`, on either device.
AMPX_HD float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  return std::bit_cast<float>(bits);
#endif
}

}  // namespace detail
}  // namespace ampx
