#pragma once

// The arithmetic of FP8 scaling, written once for both devices: the CPU
// paths (cast.cpp's quantize, scaling.cpp's scale formulas) and the CUDA
// kernels (fp8/cuda/cast_kernels.cu) run these functions, so the CPU tests
// check what the GPU computes, as optim/fused/optim_math.h does for the
// optimizers. The .cu files are compiled without FMA contraction
// (--fmad=false), so a division or a product rounds once on both.
//
//   encode<kE4M3>(x * scale)          the code: saturated, nearest even
//   amax_bits(x) / amax_of_bits(b)    |x| as bits, whose unsigned max is the
//                                     float max with NaN above everything
//   current_scale(amax, 448, eps, p2) TE's compute_scale_from_amax
//   delayed_choice / delayed_scale    TE's amax_and_scale_update, per state

#include "../kernels/host_device.h"
#include "element_code.h"

#include <cfloat>
#include <cstdint>

namespace ampx {
namespace fp8 {
namespace math {

/// The constants of an FP8 format, as template arguments of encode().
enum class Format { kE4M3, kE5M2 };

/// The FP8 code of float32 y: saturated to +-max, nearest even, NaN to 0x7F
/// with the sign; cast.h's encode(), without branches.
template <Format kFormat>
AMPX_HD uint8_t encode(float y) {
  if constexpr (kFormat == Format::kE4M3) {
    return fp8::detail::encode_branchless<3, 7, 8, true>(y, 448.0f, 0x7Eu);
  } else {
    return fp8::detail::encode_branchless<2, 15, 8, true>(y, 57344.0f, 0x7Bu);
  }
}

/// The largest finite value of a format.
AMPX_HD float max_of(Format format) {
  return format == Format::kE4M3 ? 448.0f : 57344.0f;
}

/// |y| as bits: among non-negative floats (NaN's bits above +inf's) the
/// unsigned order is the float order, so a max over these bits is the amax,
/// NaN when any element is NaN, in any order of the elements.
AMPX_HD uint32_t amax_bits(float y) {
  return ampx::detail::float_bits(y) & 0x7FFFFFFFu;
}

/// The amax that a max over amax_bits() gave.
AMPX_HD float amax_of_bits(uint32_t bits) {
  return ampx::detail::bits_float(bits);
}

AMPX_HD bool is_finite(float x) {
  return (ampx::detail::float_bits(x) & 0x7F800000u) != 0x7F800000u;
}

AMPX_HD bool is_nan(float x) {
  return (ampx::detail::float_bits(x) & 0x7FFFFFFFu) > 0x7F800000u;
}

/// TE's compute_scale_from_amax (current scaling): amax floored at
/// amax_epsilon (NaN stays NaN); fp8_max / amax in float32, FLT_MAX where
/// that overflows, truncated to a power of two with power_2_scale; 1 when
/// the floored amax is 0, inf or NaN.
AMPX_HD float current_scale(float amax, float fp8_max, float amax_epsilon, bool power_2_scale) {
  const float a = amax < amax_epsilon ? amax_epsilon : amax;
  float scale = fp8_max / a;
  if (!is_finite(scale) && !is_nan(scale)) scale = FLT_MAX;
  if (power_2_scale) scale = ampx::detail::bits_float(ampx::detail::float_bits(scale) & 0xFF800000u);
  return is_finite(a) && a != 0.0f ? scale : 1.0f;
}

/// One entry of the delayed-scaling window into the running max: NaN entries
/// drop out (CUDA's fmaxf), the max starts from 0.
AMPX_HD float window_max(float running, float entry) {
  return is_nan(entry) || entry <= running ? running : entry;
}

/// The scale a delayed-scaling state moves to from the amax its algorithm
/// chose: scaled_max / chosen when chosen is finite and > 0 (FLT_MAX where
/// that overflows), else the previous scale.
AMPX_HD float delayed_scale(float chosen, float scaled_max, float previous) {
  if (!(is_finite(chosen) && chosen > 0.0f)) return previous;
  const float scale = scaled_max / chosen;
  return is_finite(scale) ? scale : FLT_MAX;
}

/// Whether a step's amax moves the state at all: a zero amax (no data) leaves
/// history and scale as they were.
AMPX_HD bool delayed_seen(float amax) {
  return amax != 0.0f;
}

/// The history after a seen step, entry i of `len` (TE's layout: oldest kept
/// at 1, newest at len - 1, slot 0 zeroed for the next step): the window
/// (entries 1..len-1, then the step's amax) with its first entry zeroed.
AMPX_HD float rolled_entry(const float* history, int64_t len, int64_t i, float amax) {
  if (i == 0) return 0.0f;
  return i == len - 1 ? amax : history[i + 1];
}

}  // namespace math
}  // namespace fp8
}  // namespace ampx
