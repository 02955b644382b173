#pragma once

/// \file
/// FP8 formats and casts: round-to-nearest-even with saturation, exact on every
/// CPU and on every LibTorch (1.13 has no float8 dtypes, so codes are uint8).
///
/// ```
///   auto x = torch::tensor({1.0f, 300.0f, 1000.0f, -0.0f});
///   auto scale = torch::ones({}, torch::kFloat);
///   auto codes = ampx::fp8::quantize(x, ampx::fp8::Fp8Format::kE4M3, scale);
///   // uint8 {0x38, 0x79, 0x7E, 0x80}: 300 rounds to 288, 1000 saturates to 448
///   ampx::fp8::dequantize(codes, ampx::fp8::Fp8Format::kE4M3, scale);  // {1, 288, 448, -0}
///   ampx::fp8::round_to_fp8(x, ampx::fp8::Fp8Format::kE4M3);          // same, in x's dtype
/// ```
///
/// The cast is TE's saturating one: x * scale is computed in float32, clamped to
/// [-max, max] (so +-inf becomes +-max in both formats), then rounded to nearest,
/// ties to even; NaN stays NaN (code 0x7F, 0xFF with the sign bit, in both
/// formats, as PyTorch writes it). Over the clamped range this is bit for bit
/// what PyTorch 2.1+'s `.to(torch.float8_e4m3fn)` / `.to(torch.float8_e5m2)`
/// gives (tests/fp8/fp8_cast_test.cpp checks it against PyTorch 2.6).
///
/// E4M3 here is the "fn" variant: bias 7, no inf, NaN only at S.1111.111,
/// max 448, smallest subnormal 2^-9. E5M2 is IEEE-like: bias 15, inf at
/// S.11111.00, max 57344, smallest subnormal 2^-16.
///
/// CPU: our own kernel, integer bit manipulation on float32 without branches
/// (bf16/fp16 inputs are widened to float32 first, which is exact), parallel
/// over elements. CUDA: ampx's cast kernel, one pass, no host sync, running
/// the same per-element function as the CPU kernel (src/fp8/fp8_math.h).
/// Another device: the tensor is copied to the host, cast there and copied
/// back (slow, synchronizing).

#include "ampx/detail/compat.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/version.h>

#include <cstdint>
#include <string>

namespace ampx {
namespace fp8 {

/// The two 8-bit element formats.
enum class Fp8Format {
  kE4M3,  ///< 4 exponent bits, 3 mantissa bits, "fn": finite only, max 448
  kE5M2,  ///< 5 exponent bits, 2 mantissa bits, has inf, max 57344
};

/// TE's `recipe.Format`: which element format each pass of a recipe uses
/// (ampx/fp8/scaling.h, ampx/fp8/block_recipe.h).
enum class RecipeFormat {
  kE4M3,    ///< E4M3 in both passes
  kHybrid,  ///< E4M3 forward (inputs, weights), E5M2 backward (gradients)
  kE5M2,    ///< E5M2 in both: refused by the recipes, as TE refuses it
};


/// The exact constants of a format.
struct Fp8Limits {
  const char* name;     ///< "e4m3" or "e5m2"
  int exponent_bits;    ///< 4, 5
  int mantissa_bits;    ///< 3, 2
  int bias;             ///< 7, 15
  float max;            ///< 448, 57344
  float min_normal;     ///< 2^-6, 2^-14
  float min_subnormal;  ///< 2^-9, 2^-16
  uint8_t max_code;     ///< 0x7E, 0x7B: the code of +max
  uint8_t nan_code;     ///< 0x7F in both (0xFF with the sign): what NaN becomes
};

/// The constants of `format`.
const Fp8Limits& limits(Fp8Format format);

/// "e4m3", "e5m2".
std::string to_string(Fp8Format format);

/// The value a code stands for (NaN for NaN codes, +-inf for E5M2's inf codes).
float decode(uint8_t code, Fp8Format format);

/// The code of float32 `value` after saturation to +-max and rounding to
/// nearest even (NaN -> 0x7F | sign). The scalar form of quantize().
uint8_t encode(float value, Fp8Format format);

/// FP8 codes (uint8, x's shape) of x * scale: float32 product, saturated to
/// +-max, rounded to nearest even. x: float32, bfloat16 or float16; scale: a
/// float32 tensor of one element on x's device (TE's per-tensor scale).
[[nodiscard]] at::Tensor quantize(const at::Tensor& x, Fp8Format format, const at::Tensor& scale);

/// The values of `codes` (uint8) times scale_inv (one float32 element),
/// computed in float32 and returned in `out_dtype` (float32, bfloat16, float16).
[[nodiscard]] at::Tensor dequantize(const at::Tensor& codes, Fp8Format format,
                                    const at::Tensor& scale_inv,
                                    c10::ScalarType out_dtype = c10::ScalarType::Float);

/// FP8 values as they travel: one-byte codes, the scale_inv they decode
/// with, and their format. What quantize_current() and an FP8 layer's casts
/// give, and what its products take; quantize() and dequantize() above are
/// its two halves, for callers that hold the pieces.
///
/// ```
///   auto t = ampx::fp8::Fp8Tensor::quantize(x, Fp8Format::kE4M3, scale);
///   t.codes;         // uint8, x's shape: quantize(x, kE4M3, scale)
///   t.scale_inv;     // float32, one element: 1 / scale
///   t.dequantize();  // float32: x * scale on the E4M3 grid, times 1 / scale
/// ```
struct Fp8Tensor {
  at::Tensor codes;      ///< uint8
  at::Tensor scale_inv;  ///< float32, one element: multiplies the codes' values back
  Fp8Format format = Fp8Format::kE4M3;  ///< the codes' format

  /// The codes of x * scale (see quantize()) and scale_inv = 1 / scale,
  /// computed in float32 on scale's device.
  [[nodiscard]] static Fp8Tensor quantize(const at::Tensor& x, Fp8Format format,
                                          const at::Tensor& scale);
  /// The values: codes times scale_inv, computed in float32 and returned in
  /// `out_dtype` (float32, bfloat16, float16). dequantize() is this.
  [[nodiscard]] at::Tensor dequantize(c10::ScalarType out_dtype = c10::ScalarType::Float) const;
};

/// Fake quantization: x rounded to the FP8 grid (saturated, nearest even),
/// returned in x's dtype. Equals dequantize(quantize(x, f, 1), f, 1, x.dtype()).
[[nodiscard]] at::Tensor round_to_fp8(const at::Tensor& x, Fp8Format format);

#if AMPX_HAS_TORCH_FLOAT8
/// at::kFloat8_e4m3fn or at::kFloat8_e5m2.
c10::ScalarType torch_dtype(Fp8Format format);

/// The uint8 codes reinterpreted as PyTorch's float8 dtype: a view, no rounding.
[[nodiscard]] at::Tensor codes_to_torch_float8(const at::Tensor& codes, Fp8Format format);

/// A float8 tensor's bytes as uint8 codes: a view, no rounding.
[[nodiscard]] at::Tensor torch_float8_to_codes(const at::Tensor& x);
#endif

}  // namespace fp8
}  // namespace ampx
