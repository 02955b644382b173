#pragma once

/// \file
/// Block-scaled formats: each block of elements (1 x block_cols along the
/// last dimension, or block_rows x block_cols of a matrix) shares one scale;
/// the elements are 8-, 6- or 4-bit floats. The MX formats (OCP
/// Microscaling: MXFP8, MXFP6, MXFP4) scale by an E8M0 power of two per 32;
/// NVFP4 by an E4M3 scale per 16 under a float32 scale per tensor (as
/// Transformer Engine computes it); FP8 blockwise (DeepSeek-V3, TE's
/// Float8BlockScaling) by a float32 scale per 1 x 128 or 128 x 128 block.
///
/// ```
///   auto x = torch::randn({4, 64});
///   auto mx = ampx::fp8::BlockTensor::quantize(x, ampx::fp8::BlockFormat::mxfp4());
///   mx.codes;         // uint8 [4, 64]: one E2M1 code per element (pack_fp4 halves it)
///   mx.scales;        // uint8 [4, 2]: E8M0 bytes, 2^(byte - 127), 0xFF NaN
///   mx.dequantize();  // float32 [4, 64]
///   auto nv = ampx::fp8::BlockTensor::quantize(x, ampx::fp8::BlockFormat::nvfp4());
///   nv.scales;        // uint8 [4, 4]: E4M3 bytes; nv.global_amax: x's amax
/// ```
///
/// Elements: x divided by its block's scale, saturated to the format's
/// largest magnitude and rounded to nearest even (sign kept, -0 included),
/// or stochastically where asked (below). E4M3 and E5M2 are the FP8 formats
/// of ampx/fp8/cast.h (a NaN element stays NaN); E3M2 (max 28), E2M3 (7.5)
/// and E2M1 (6; values 0, 0.5, 1, 1.5, 2, 3, 4, 6) have no NaN or inf: a NaN
/// element has no code of its own (it is written as zero with its sign), and
/// its block's scale is NaN, which makes the whole block NaN when
/// dequantized (OCP MX 1.0, section 5.1).
///
/// The E8M0 scale of a block, from its amax (the largest |x|), by one of
/// the rules in use (bit for bit as torchao 0.18's `to_mx` computes them,
/// except where noted):
///
/// | rule | the scale's exponent | amax inf | amax NaN |
/// | --- | --- | --- | --- |
/// | kFloor (OCP section 6.3, torchao FLOOR) | floor(log2 amax) - emax_elem | exponent 128 - emax_elem | 0xFF |
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
/// kNvfp4 (E2M1 elements only; Transformer Engine's arithmetic, in float32):
/// the tensor's global amax gives `S_enc = min(448 * 6 / global_amax,
/// FLT_MAX)` (1 when that amax is 0); each block's E4M3 scale is
/// `e4m3(block_amax * (S_enc * (1 / 6)))`, rounded once, with no lower
/// clamp (a zero scale is legal); its elements are
/// `e2m1(x * min(1 / (scale * (1 / S_enc)), FLT_MAX))`. Products multiply
/// the codes times their E4M3 scales and the sum by `amax_a * amax_b /
/// (6 * 6 * 448 * 448)` (TE's GEMM alpha); dequantize() alone multiplies by
/// `global_amax / (6 * 448)`. A NaN in the tensor makes every scale NaN
/// (E4M3's 0x7F). torchao's NVFP4 tensor is another recipe (it clamps block
/// scales below at 2^-9, and divides in another order): not this one.
///
/// kFloat32 and kFloat32Pow2 (TE's Float8BlockScaling, DeepSeek-V3's blocks;
/// FP8 elements): `scale = max_elem / max(amax, amax_epsilon)` in float32
/// (1 when that amax is 0, FLT_MAX where the quotient overflows),
/// kFloat32Pow2 rounding it down to a power of two; elements
/// `e4m3(x * scale)`; the stored scale is the decoding one, `1 / scale`.
///
/// Stochastic rounding (what NVFP4 does to gradients): an element between
/// two neighbouring codes goes up with probability equal to its distance
/// from the lower one over their spacing, from a counter-based random
/// stream (seed, offset + the element's index): the same codes for the same
/// seed on any number of threads; saturation as in rounding to nearest.
///
/// CPU or CUDA tensors (float32, bfloat16, float16): a CUDA tensor's codes
/// and scales are the CPU's bit for bit (one arithmetic for both devices;
/// an element's code keeps the element's sign where its scaled value is
/// NaN, a NaN float32 scale is 0x7FC00000). Blocks that do not divide the
/// dimensions are cut short at the end (amax over the elements there); 2-D
/// blocks take a 2-D tensor. Not here yet: TE's "4over6" NVFP4 variant.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include <cstdint>
#include <string>

namespace ampx {
namespace fp8 {

/// The element formats of the block-scaled types.
enum class ElementFormat {
  kE4M3,  ///< FP8, max 448 (MXFP8, FP8 blockwise)
  kE5M2,  ///< FP8, max 57344 (MXFP8, FP8 blockwise)
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

/// How a block's scale follows from its amax (the table above).
enum class ScaleRule {
  kFloor,         ///< E8M0, OCP's rule
  kCeil,          ///< E8M0, torchao's CEIL
  kEven,          ///< E8M0, torchao's EVEN
  kRceil,         ///< E8M0, NVIDIA's round-up (TE's MXFP8)
  kNvfp4,         ///< E4M3 block scales under a float32 tensor scale (TE's NVFP4)
  kFloat32,       ///< float32 block scales (DeepSeek-V3's blocks)
  kFloat32Pow2,   ///< float32 block scales, powers of two (TE's Float8BlockScaling)
};

/// "floor", "ceil", "even", "rceil", "nvfp4", "float32", "float32-pow2".
std::string to_string(ScaleRule rule);

/// Whether `rule` writes E8M0 scale bytes (the MX rules).
bool is_e8m0(ScaleRule rule);

/// The code of float32 `value` (already divided by its scale): saturated to
/// +-max, rounded to nearest even, in the low `bits` bits.
uint8_t encode_element(float value, ElementFormat format);

/// The code of float32 `value` rounded stochastically: up to the next code
/// with probability (|value| - lower) / (upper - lower), where `random` is
/// uniform in [0, 2^32); saturated to +-max; NaN as encode_element.
uint8_t encode_element_stochastic(float value, ElementFormat format, uint32_t random);

/// The value of an element code (NaN for E4M3's and E5M2's NaN codes).
float decode_element(uint8_t code, ElementFormat format);

/// The E8M0 scale byte of a block whose amax (float32) is `amax`, by one of
/// the E8M0 rules.
uint8_t scale_byte(float amax, ElementFormat format, ScaleRule rule);

/// 2^(byte - 127) as a float32 (byte 0: 2^-127, a subnormal), NaN for 0xFF.
float scale_value(uint8_t byte);

/// NVFP4's tensor-level encoding scale S_enc of a tensor whose amax is
/// `global_amax`: min(448 * 6 / global_amax, FLT_MAX), 1 when that is 0.
float nvfp4_encode_scale(float global_amax);

/// The element format, scale rule and block shape of a block-scaled
/// tensor; the named formats below, or set by chained calls:
/// `BlockFormat(ElementFormat::kE4M3, ScaleRule::kRceil).block_rows(32)`.
struct BlockFormat {
  /// Elements of `element`, scales by `rule`, blocks of 1 x 32.
  BlockFormat(ElementFormat element, ScaleRule rule) : element_(element), rule_(rule) {}
  /// MXFP8: E4M3 (or E5M2) elements, E8M0 scales per 1 x 32 (TE's rule).
  static BlockFormat mxfp8(ElementFormat element = ElementFormat::kE4M3,
                           ScaleRule rule = ScaleRule::kRceil);
  /// MXFP6: E3M2 or E2M3 elements, E8M0 scales per 1 x 32.
  static BlockFormat mxfp6(ElementFormat element = ElementFormat::kE2M3,
                           ScaleRule rule = ScaleRule::kRceil);
  /// MXFP4: E2M1 elements, E8M0 scales per 1 x 32.
  static BlockFormat mxfp4(ScaleRule rule = ScaleRule::kRceil);
  /// NVFP4: E2M1 elements, E4M3 scales per 1 x 16, a float32 tensor scale.
  static BlockFormat nvfp4();
  /// FP8 blockwise: E4M3 elements, power-of-two float32 scales per 1 x 128
  /// (activations, gradients; block_rows(128) for weights).
  static BlockFormat fp8_blockwise();

  /// Throws c10::ValueError naming what is wrong (a block of size < 1,
  /// NVFP4 with elements other than E2M1, float32 scales with FP6/FP4).
  void validate() const;
  /// E.g. "e4m3/rceil/1x32".
  std::string to_string() const;
  /// Every field the same: the same codes and scales from the same values.
  bool operator==(const BlockFormat& other) const {
    return element_ == other.element_ && rule_ == other.rule_ && block_rows_ == other.block_rows_ &&
           block_cols_ == other.block_cols_ && amax_epsilon_ == other.amax_epsilon_;
  }
  /// Some field differs.
  bool operator!=(const BlockFormat& other) const { return !(*this == other); }

  /// The elements' format.
  TORCH_ARG(ElementFormat, element);
  /// How each block's scale is chosen.
  TORCH_ARG(ScaleRule, rule);
  /// A block's rows (1: blocks along the last dimension only).
  TORCH_ARG(int64_t, block_rows) = 1;
  /// A block's columns, along the last dimension.
  TORCH_ARG(int64_t, block_cols) = 32;
  /// kFloat32 rules: the smallest amax a scale is computed from.
  TORCH_ARG(double, amax_epsilon) = 0.0;
};

/// Rounding elements stochastically: the stream's seed and where in it this
/// tensor starts (element i uses the stream's number offset + i).
struct StochasticRounding {
  uint64_t seed = 0;    ///< the stream
  uint64_t offset = 0;  ///< the first element's place in the stream
};

/// A tensor in a block-scaled format: codes, one scale per block, and how
/// they were made.
struct BlockTensor {
  /// uint8, the input's shape: one element code a byte.
  at::Tensor codes;
  /// One per block: x's shape with its last dimension divided (rounded up)
  /// by block_cols and, for 2-D blocks, its first by block_rows. uint8 E8M0
  /// bytes (MX rules), uint8 E4M3 bytes (kNvfp4), or float32 decoding scales.
  at::Tensor scales;
  /// kNvfp4: the tensor's amax, whence S_enc; 0 for the other rules.
  float global_amax = 0.0f;
  /// The format the codes and scales are in.
  BlockFormat format = BlockFormat::mxfp8();

  /// x (float32, bfloat16 or float16, on the CPU or a CUDA device) in
  /// `format`, rounded to nearest even, or stochastically when `stochastic`
  /// is given; codes and scales on x's device. On CUDA, NVFP4 reads its
  /// global amax back to the host once, after the launches. `global_amax`
  /// (kNvfp4 only): the amax S_enc is taken from, instead of x's own, where
  /// x is a part of a larger tensor (a rank's shard of a weight) quantized
  /// as that tensor would be; NaN where any of its elements is.
  [[nodiscard]] static BlockTensor quantize(
      const at::Tensor& x, const BlockFormat& format,
      const c10::optional<StochasticRounding>& stochastic = c10::nullopt,
      const c10::optional<float>& global_amax = c10::nullopt);
  /// The codes times their block's scale in float32 (exact), without the
  /// tensor scale of kNvfp4: what a block-scaled product multiplies.
  [[nodiscard]] at::Tensor block_values() const;
  /// What the products multiply block_values() by: global_amax / (6 * 448)
  /// for kNvfp4, 1 otherwise.
  float tensor_scale() const;
  /// The values, block_values() times tensor_scale(), in out_dtype
  /// (float32, bfloat16 or float16); a NaN scale's block is NaN.
  [[nodiscard]] at::Tensor dequantize(c10::ScalarType out_dtype = c10::ScalarType::Float) const;
  /// The transpose of a 2-D tensor in 2-D blocks (codes, scales and the
  /// block shape transposed): what a product along the other dimension
  /// takes, with no second quantization.
  [[nodiscard]] BlockTensor transposed() const;
};

/// a [M, K] times b [N, K] transposed, each in blocks along K (rows of b
/// for b's 2-D blocks): block values multiplied and summed in float32, then
/// times both tensor scales (for NVFP4 TE's alpha, amax_a * amax_b /
/// (6 * 6 * 448 * 448)). [M, N] float32.
[[nodiscard]] at::Tensor block_scaled_mm(const BlockTensor& a, const BlockTensor& b);

/// The 16-point random Hadamard transform of NVFP4's weight-gradient
/// operands, along the last dimension (a multiple of 16) in tiles of 16:
/// each tile, a row vector, times H = S * H16 / 4 (H16 Sylvester's Hadamard
/// matrix, S the diagonal of TE's fixed sign vector); `inverse` multiplies
/// by H^T. H is orthogonal: the transform of both operands of a product
/// along its inner dimension leaves the product unchanged. `dim` 0 (a 2-D
/// x) transforms down the columns instead, each column's tiles as the row
/// tiles are: hadamard16(x, inverse, 0) is hadamard16(x.t(), inverse).t().
/// float32 out.
[[nodiscard]] at::Tensor hadamard16(const at::Tensor& x, bool inverse = false, int64_t dim = -1);

/// E2M1 codes (uint8, last dimension even) two to a byte: element 2i in the
/// low nibble, 2i + 1 in the high one (the OCP and torchao layout).
[[nodiscard]] at::Tensor pack_fp4(const at::Tensor& codes);

/// The inverse of pack_fp4: one code a byte, the last dimension doubled.
[[nodiscard]] at::Tensor unpack_fp4(const at::Tensor& packed);

}  // namespace fp8
}  // namespace ampx
