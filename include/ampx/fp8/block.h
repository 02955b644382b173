#pragma once

/// \file
/// Block-scaled formats (OCP Microscaling, "MX"): each block of `block_size`
/// consecutive elements along the last dimension shares one E8M0 scale, a
/// power of two; the elements are 8-, 6- or 4-bit floats.
///
/// ```
///   auto x = torch::randn({4, 64});
///   auto mx = ampx::fp8::MxTensor::quantize(x, ampx::fp8::ElementFormat::kE2M1,
///                                           ampx::fp8::ScaleRule::kRceil);  // MXFP4
///   mx.codes;         // uint8 [4, 64]: one E2M1 code per element (pack_fp4 halves it)
///   mx.scales;        // uint8 [4, 2]: E8M0 bytes, 2^(byte - 127), 0xFF NaN
///   mx.dequantize();  // float32 [4, 64]
/// ```
///
/// Elements: x / 2^scale, saturated to the format's largest magnitude and
/// rounded to nearest even (sign kept, -0 included). E4M3 and E5M2 are the
/// FP8 formats of ampx/fp8/cast.h (a NaN element stays NaN); E3M2 (max 28),
/// E2M3 (7.5) and E2M1 (6; values 0, 0.5, 1, 1.5, 2, 3, 4, 6) have no NaN
/// or inf: a NaN element has no code of its own (it is written as zero with
/// its sign), and its block's scale is NaN, which makes the whole block NaN
/// when dequantized (OCP MX 1.0, §5.1).
///
/// The shared scale of a block, from its amax (the largest |x|), by one of
/// the rules in use (bit for bit as torchao 0.18's `to_mx` computes them,
/// except where noted):
///
/// | rule | the scale's exponent | amax inf | amax NaN |
/// | --- | --- | --- | --- |
/// | kFloor (OCP §6.3, torchao FLOOR) | floor(log2 amax) - emax_elem | exponent 128 - emax_elem | 0xFF |
/// | kCeil (torchao CEIL) | as kFloor, +1 when amax is not a power of two | as kFloor | 0xFF |
/// | kEven (torchao EVEN) | as kFloor, on amax rounded to the element's mantissa bits first | as kFloor | 0xFF |
/// | kRceil (NVIDIA, cuBLAS, TE's MXFP8, torchao RCEIL) | ceil(log2(amax / max_elem)) | 0xFE | 0xFF |
///
/// emax_elem is the largest power of two of the element format (8, 15, 4, 2,
/// 2 for E4M3, E5M2, E3M2, E2M3, E2M1); exponents below -127 become -127
/// (byte 0), and the byte is the exponent plus 127.
/// kRceil rounds up exactly: amax / max_elem (one float32 division) is
/// raised to the next power of two unless it is one. torchao's eager
/// fallback takes `ceil(log2(...))` in float32, which differs where that
/// quotient lies within log2's rounding above a power of two; the hardware
/// instruction (`cvt.rp.satfinite.ue8m0x2.f32`) rounds as ampx does.
///
/// Where ampx departs from torchao on purpose, in blocks whose scale byte is
/// 0 (2^-127, a float32 subnormal: a block of zeros or of amax below about
/// 2^-119): ampx divides by 2^-127 as the byte says (it never flushes the
/// subnormal), torchao divides by 2^-126 under kFloor, kCeil and kEven and
/// multiplies by 1 under kRceil. In every other block the codes are torchao's.
/// With kRceil the elements are x times the scale's reciprocal (exact: a
/// power of two), as torchao's RCEIL and TE compute them; under the other
/// rules x divided by the scale; both are the same float32 value.
///
/// CPU tensors (float32, bfloat16, float16); the last dimension a multiple
/// of block_size. CUDA, 2-D weight blocks, NVFP4's E4M3 scales and the
/// recipes in fp8::Linear are not here yet.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace ampx {
namespace fp8 {

/// The element formats of the block-scaled types.
enum class ElementFormat {
  kE4M3,  ///< FP8, max 448 (MXFP8)
  kE5M2,  ///< FP8, max 57344 (MXFP8)
  kE3M2,  ///< FP6, max 28 (MXFP6)
  kE2M3,  ///< FP6, max 7.5 (MXFP6)
  kE2M1,  ///< FP4, max 6 (MXFP4, NVFP4)
};

/// The exact constants of an element format.
struct ElementLimits {
  const char* name;   ///< "e4m3", "e5m2", "e3m2", "e2m3", "e2m1"
  int exponent_bits;  ///< 4, 5, 3, 2, 2
  int mantissa_bits;  ///< 3, 2, 2, 3, 1
  int bias;           ///< 7, 15, 3, 1, 1
  float max;          ///< 448, 57344, 28, 7.5, 6
  int max_pow2;       ///< emax_elem: 8, 15, 4, 2, 2
  uint8_t max_code;   ///< the code of +max: 0x7E, 0x7B, 0x1F, 0x1F, 0x7
  int bits;           ///< 8, 8, 6, 6, 4: the code's width (sign included)
};

/// The constants of `format`.
const ElementLimits& limits(ElementFormat format);

/// "e4m3", "e5m2", "e3m2", "e2m3", "e2m1".
std::string to_string(ElementFormat format);

/// How a block's shared scale follows from its amax (table above).
enum class ScaleRule { kFloor, kCeil, kEven, kRceil };

/// "floor", "ceil", "even", "rceil".
std::string to_string(ScaleRule rule);

/// The code of float32 `value` (already divided by its scale): saturated to
/// +-max, rounded to nearest even, in the low `bits` bits.
uint8_t encode_element(float value, ElementFormat format);

/// The value of an element code (NaN for E4M3's and E5M2's NaN codes).
float decode_element(uint8_t code, ElementFormat format);

/// The E8M0 scale byte of a block whose amax (float32) is `amax`.
uint8_t scale_byte(float amax, ElementFormat format, ScaleRule rule);

/// 2^(byte - 127) as a float32 (byte 0: 2^-127, a subnormal), NaN for 0xFF.
float scale_value(uint8_t byte);

/// A tensor in a block-scaled format: codes, one E8M0 scale per block of
/// block_size elements along the last dimension, and how they were made.
struct MxTensor {
  at::Tensor codes;   ///< uint8, the input's shape: one element code a byte
  at::Tensor scales;  ///< uint8 [..., last / block_size]: E8M0 bytes
  ElementFormat format = ElementFormat::kE4M3;  ///< the elements' format
  ScaleRule rule = ScaleRule::kFloor;           ///< how the scales were chosen
  int64_t block_size = 32;                      ///< elements a scale covers

  /// x (float32, bfloat16 or float16, on the CPU) in blocks of block_size
  /// along its last dimension, which block_size must divide.
  [[nodiscard]] static MxTensor quantize(const at::Tensor& x, ElementFormat format,
                                         ScaleRule rule, int64_t block_size = 32);
  /// The values, codes times their block's scale in float32, returned in
  /// out_dtype (float32, bfloat16 or float16); a 0xFF block is NaN.
  [[nodiscard]] at::Tensor dequantize(c10::ScalarType out_dtype = c10::ScalarType::Float) const;
};

/// E2M1 codes (uint8, last dimension even) two to a byte: element 2i in the
/// low nibble, 2i + 1 in the high one (the OCP and torchao layout).
[[nodiscard]] at::Tensor pack_fp4(const at::Tensor& codes);

/// The inverse of pack_fp4: one code a byte, the last dimension doubled.
[[nodiscard]] at::Tensor unpack_fp4(const at::Tensor& packed);

}  // namespace fp8
}  // namespace ampx
