// Block-scaled formats (ampx/fp8/block.h): element codes, the scale rules
// (E8M0, NVFP4's E4M3 under a tensor scale, float32), BlockTensor's casts and
// products, the Hadamard transform and FP4 packing, on the CPU.

#include "ampx/fp8/block.h"

#include "ampx/fp8/cast.h"

#include "../float_formats.h"
#include "block_internal.h"
#include "element_code.h"
#include "../kernels/function_args.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

namespace ampx {
namespace fp8 {
namespace {

constexpr int kScaleBias = 127;
constexpr uint8_t kScaleNan = 0xFF;

// The constants are the shared table's (src/float_formats.h).
constexpr ElementLimits element_limits(const char* name, const ampx::detail::FloatFormatSpec& s) {
  return {name,           s.exponent_bits,   s.mantissa_bits,
          s.bias,         s.max,             s.max_exponent(),
          static_cast<uint8_t>(s.max_bits()), 1 + s.exponent_bits + s.mantissa_bits};
}

constexpr ElementLimits kLimits[] = {
    element_limits("e4m3", ampx::detail::kE4M3), element_limits("e5m2", ampx::detail::kE5M2),
    element_limits("e3m2", ampx::detail::kE3M2), element_limits("e2m3", ampx::detail::kE2M3),
    element_limits("e2m1", ampx::detail::kE2M1),
};

bool is_fp8(ElementFormat f) { return f == ElementFormat::kE4M3 || f == ElementFormat::kE5M2; }

Fp8Format fp8_format(ElementFormat f) {
  return f == ElementFormat::kE4M3 ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
}

// FP6 and FP4 (no inf, no NaN): |value| >= max saturates, everything else
// rounds to nearest even on the format's grid (element_code.h).
uint8_t encode_small(float value, const ElementLimits& l) {
  const uint8_t sign = std::signbit(value) ? static_cast<uint8_t>(1u << (l.bits - 1)) : 0;
  const float a = std::fabs(value);
  if (std::isnan(a)) return sign;  // no NaN code: the block's NaN scale carries it
  if (a >= l.max) return sign | l.max_code;
  return sign | static_cast<uint8_t>(
                    detail::magnitude_code(std::bit_cast<uint32_t>(a), l.bias, l.mantissa_bits));
}

float decode_small(uint8_t code, const ElementLimits& l) {
  const float value = detail::magnitude_value(code & ((1u << (l.bits - 1)) - 1), l.bias,
                                              l.mantissa_bits);
  return (code >> (l.bits - 1)) & 1 ? -value : value;
}

// The biased exponent field of a float32 (0 for zeros and subnormals, 255
// for inf and NaN), and whether its mantissa is nonzero.
int exponent_field(float v) { return static_cast<int>((std::bit_cast<uint32_t>(v) >> 23) & 0xFF); }
bool has_mantissa(float v) { return (std::bit_cast<uint32_t>(v) & 0x7FFFFF) != 0; }

uint8_t biased(int exponent) {
  return static_cast<uint8_t>(std::clamp(exponent, -kScaleBias, kScaleBias + 1) + kScaleBias);
}

// Calls fn with the element format's branchless encoder (element_code.h):
// fn(encode) where encode(float) gives the code.
template <class Fn>
void with_encoder(ElementFormat format, Fn&& fn) {
  const ElementLimits& l = limits(format);
  const float max = l.max;
  const uint32_t max_code = l.max_code;
  switch (format) {
    case ElementFormat::kE4M3:
      return fn([=](float y) { return detail::encode_branchless<3, 7, 8, true>(y, max, max_code); });
    case ElementFormat::kE5M2:
      return fn([=](float y) { return detail::encode_branchless<2, 15, 8, true>(y, max, max_code); });
    case ElementFormat::kE3M2:
      return fn([=](float y) { return detail::encode_branchless<2, 3, 6, false>(y, max, max_code); });
    case ElementFormat::kE2M3:
      return fn([=](float y) { return detail::encode_branchless<3, 1, 6, false>(y, max, max_code); });
    case ElementFormat::kE2M1:
      return fn([=](float y) { return detail::encode_branchless<1, 1, 4, false>(y, max, max_code); });
  }
}

// Calls fn with the element format's stochastic encoder: fn(encode) where
// encode(float, uint32_t random) gives the code.
template <class Fn>
void with_stochastic_encoder(ElementFormat format, Fn&& fn) {
  const ElementLimits& l = limits(format);
  const float max = l.max;
  const uint32_t max_code = l.max_code;
  static const auto tables = [] {
    std::array<std::array<float, 256>, 5> t{};
    for (int f = 0; f < 5; ++f) {
      for (int c = 0; c < 256; ++c) {
        t[f][c] = c <= limits(static_cast<ElementFormat>(f)).max_code
                      ? decode_element(static_cast<uint8_t>(c), static_cast<ElementFormat>(f))
                      : 0.0f;
      }
    }
    return t;
  }();
  const float* values = tables[static_cast<int>(format)].data();
  switch (format) {
    case ElementFormat::kE4M3:
      return fn([=](float y, uint32_t r) {
        return detail::encode_stochastic_branchless<3, 7, 8, true>(y, max, max_code, values, r);
      });
    case ElementFormat::kE5M2:
      return fn([=](float y, uint32_t r) {
        return detail::encode_stochastic_branchless<2, 15, 8, true>(y, max, max_code, values, r);
      });
    case ElementFormat::kE3M2:
      return fn([=](float y, uint32_t r) {
        return detail::encode_stochastic_branchless<2, 3, 6, false>(y, max, max_code, values, r);
      });
    case ElementFormat::kE2M3:
      return fn([=](float y, uint32_t r) {
        return detail::encode_stochastic_branchless<3, 1, 6, false>(y, max, max_code, values, r);
      });
    case ElementFormat::kE2M1:
      return fn([=](float y, uint32_t r) {
        return detail::encode_stochastic_branchless<1, 1, 4, false>(y, max, max_code, values, r);
      });
  }
}

}  // namespace

const ElementLimits& limits(ElementFormat format) {
  return kLimits[static_cast<int>(format)];
}

std::string to_string(ElementFormat format) { return limits(format).name; }

std::string to_string(ScaleRule rule) {
  switch (rule) {
    case ScaleRule::kFloor: return "floor";
    case ScaleRule::kCeil: return "ceil";
    case ScaleRule::kEven: return "even";
    case ScaleRule::kRceil: return "rceil";
    case ScaleRule::kNvfp4: return "nvfp4";
    case ScaleRule::kFloat32: return "float32";
    case ScaleRule::kFloat32Pow2: return "float32-pow2";
  }
  return "?";
}

bool is_e8m0(ScaleRule rule) {
  return rule == ScaleRule::kFloor || rule == ScaleRule::kCeil || rule == ScaleRule::kEven ||
         rule == ScaleRule::kRceil;
}

uint8_t encode_element(float value, ElementFormat format) {
  return is_fp8(format) ? encode(value, fp8_format(format)) : encode_small(value, limits(format));
}

uint8_t encode_element_stochastic(float value, ElementFormat format, uint32_t random) {
  uint8_t code = 0;
  with_stochastic_encoder(format, [&](auto encode) { code = encode(value, random); });
  return code;
}

float decode_element(uint8_t code, ElementFormat format) {
  return is_fp8(format) ? decode(code, fp8_format(format)) : decode_small(code, limits(format));
}

uint8_t scale_byte(float amax, ElementFormat format, ScaleRule rule) {
  TORCH_CHECK_VALUE(is_e8m0(rule), "ampx::fp8::scale_byte: rule ", to_string(rule),
                    " has no E8M0 scale (floor, ceil, even or rceil)");
  const ElementLimits& l = limits(format);
  if (std::isnan(amax)) return kScaleNan;
  if (rule == ScaleRule::kRceil) {
    if (std::isinf(amax)) return 0xFE;
    const float descale = amax / l.max;  // float32, as torchao and TE compute it
    if (descale == 0.0f) return 0;
    // The exponent of the next power of two at or above descale.
    int e = 0;
    const float m = std::frexp(descale, &e);  // descale = m 2^e, m in [0.5, 1)
    const int up = m == 0.5f ? e - 1 : e;
    return static_cast<uint8_t>(std::clamp(up, -kScaleBias, kScaleBias) + kScaleBias);
  }
  float a = amax;
  if (rule == ScaleRule::kEven && std::isfinite(a)) {
    // amax rounded to the element's mantissa bits (half up, on the bits), so
    // a block whose amax rounds to the next binade takes that binade.
    const uint32_t half = uint32_t{1} << (23 - l.mantissa_bits - 1);
    a = std::bit_cast<float>((std::bit_cast<uint32_t>(a) + half) & 0xFF800000u);
  }
  int exponent = exponent_field(a) - kScaleBias;  // zeros and subnormals: -127; inf: 128
  if (rule == ScaleRule::kCeil && has_mantissa(a)) exponent += 1;
  return biased(exponent - l.max_pow2);
}

float scale_value(uint8_t byte) {
  if (byte == kScaleNan) return std::numeric_limits<float>::quiet_NaN();
  return byte == 0 ? std::bit_cast<float>(uint32_t{0x00400000})
                   : std::bit_cast<float>(static_cast<uint32_t>(byte) << 23);
}

float nvfp4_encode_scale(float global_amax) {
  // TE's compute_global_encode_scaling_factor_FP4: 448 * 6 / amax, at most
  // FLT_MAX, 1 where that is 0 (a zero tensor) or the amax is 0.
  const float s = std::min(448.0f * 6.0f / global_amax, FLT_MAX);
  return global_amax == 0.0f || s == 0.0f ? 1.0f : s;
}

BlockFormat BlockFormat::mxfp8(ElementFormat element, ScaleRule rule) {
  return BlockFormat(element, rule);
}
BlockFormat BlockFormat::mxfp6(ElementFormat element, ScaleRule rule) {
  return BlockFormat(element, rule);
}
BlockFormat BlockFormat::mxfp4(ScaleRule rule) { return BlockFormat(ElementFormat::kE2M1, rule); }
BlockFormat BlockFormat::nvfp4() {
  return BlockFormat(ElementFormat::kE2M1, ScaleRule::kNvfp4).block_cols(16);
}
BlockFormat BlockFormat::fp8_blockwise() {
  return BlockFormat(ElementFormat::kE4M3, ScaleRule::kFloat32Pow2).block_cols(128);
}

void BlockFormat::validate() const {
  TORCH_CHECK_VALUE(block_rows_ >= 1 && block_cols_ >= 1,
                    "ampx::fp8::BlockFormat: block_rows and block_cols must be >= 1, got ",
                    block_rows_, " x ", block_cols_);
  TORCH_CHECK_VALUE(rule_ != ScaleRule::kNvfp4 || element_ == ElementFormat::kE2M1,
                    "ampx::fp8::BlockFormat: the nvfp4 rule takes e2m1 elements, got ",
                    fp8::to_string(element_));
  const bool fp32_scales = rule_ == ScaleRule::kFloat32 || rule_ == ScaleRule::kFloat32Pow2;
  TORCH_CHECK_VALUE(!fp32_scales || element_ == ElementFormat::kE4M3 ||
                        element_ == ElementFormat::kE5M2,
                    "ampx::fp8::BlockFormat: float32 block scales take e4m3 or e5m2 elements, got ",
                    fp8::to_string(element_));
  TORCH_CHECK_VALUE(amax_epsilon_ >= 0.0 && std::isfinite(amax_epsilon_),
                    "ampx::fp8::BlockFormat: amax_epsilon must be finite and >= 0, got ",
                    amax_epsilon_);
}

std::string BlockFormat::to_string() const {
  return fp8::to_string(element_) + "/" + fp8::to_string(rule_) + "/" +
         std::to_string(block_rows_) + "x" + std::to_string(block_cols_);
}

namespace {

// The stream's 32 random bits for element `index` (splitmix64's finaliser,
// twice): a counter-based stream, the same on any number of threads.
uint64_t mix_bits64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
uint64_t stream_key(uint64_t seed) { return mix_bits64(seed + 0x9E3779B97F4A7C15ull); }
uint32_t stream_bits(uint64_t key, uint64_t index) {
  return static_cast<uint32_t>(mix_bits64(key + index) >> 32);
}

// Every code's value, for the decoding loops.
std::array<float, 256> decode_table(ElementFormat format) {
  std::array<float, 256> t{};
  const int codes = 1 << limits(format).bits;
  for (int c = 0; c < 256; ++c) t[c] = c < codes ? decode_element(static_cast<uint8_t>(c), format) : 0;
  return t;
}

// A block's decoding scale and what its elements are multiplied by before
// the cast.
struct BlockScale {
  float decode;  // what the codes are multiplied by
  float encode;  // the elements' factor
};

BlockScale scale_of_block(float amax, const BlockFormat& f, float s_enc, void* stored) {
  const ElementLimits& l = limits(f.element());
  switch (f.rule()) {
    case ScaleRule::kNvfp4: {
      // One rounding of block_amax * (S_enc / 6) to E4M3; no lower clamp.
      const uint8_t byte = encode(amax * (s_enc * (1.0f / 6.0f)), Fp8Format::kE4M3);
      *static_cast<uint8_t*>(stored) = byte;
      const float scale = decode(byte, Fp8Format::kE4M3);
      const float inv = 1.0f / (scale * (1.0f / s_enc));
      return {scale, std::isnan(inv) ? inv : std::min(inv, FLT_MAX)};
    }
    case ScaleRule::kFloat32:
    case ScaleRule::kFloat32Pow2: {
      const float a = std::max(amax, static_cast<float>(f.amax_epsilon()));
      float scale = std::isnan(amax) ? amax : a == 0.0f ? 1.0f : l.max / a;
      if (std::isinf(scale)) scale = FLT_MAX;
      if (f.rule() == ScaleRule::kFloat32Pow2 && std::isfinite(scale) && scale > 0.0f) {
        int e = 0;
        std::frexp(scale, &e);  // scale = m 2^e, m in [0.5, 1): down to 2^(e - 1)
        scale = std::ldexp(1.0f, e - 1);
      }
      const float inv = 1.0f / scale;
      *static_cast<float*>(stored) = inv;
      return {inv, scale};
    }
    default: {
      const uint8_t byte = scale_byte(amax, f.element(), f.rule());
      *static_cast<uint8_t*>(stored) = byte;
      // x / 2^s is the same float32 as x * 2^-s (torchao's RCEIL and TE
      // multiply by the reciprocal, its other rules divide): the reciprocal
      // of a power of two from 2^-127 (a subnormal, never flushed) to 2^127
      // is exact.
      const float scale = scale_value(byte);
      return {scale, 1.0f / scale};
    }
  }
}

void check_block_input(const at::Tensor& x, const BlockFormat& format, const char* what) {
  TORCH_CHECK_VALUE(x.defined() && x.device().is_cpu(), "ampx::fp8::", what,
                    ": x must be a CPU tensor, got ",
                    x.defined() ? x.device().str() : std::string("an undefined tensor"));
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                        x.scalar_type() == at::kHalf,
                    "ampx::fp8::", what, ": x must be float32, bfloat16 or float16, got ",
                    x.scalar_type());
  format.validate();
  TORCH_CHECK_VALUE(x.dim() >= 1, "ampx::fp8::", what, ": x must have a dimension, got a scalar");
  TORCH_CHECK_VALUE(format.block_rows() == 1 || x.dim() == 2, "ampx::fp8::", what,
                    ": blocks of ", format.block_rows(), " x ", format.block_cols(),
                    " take a 2-D tensor, got ", x.sizes());
}

int64_t blocks_over(int64_t n, int64_t block) { return (n + block - 1) / block; }

}  // namespace

namespace {

// quantize's loops for blocks of br x 1 (br > 1): per block row, the
// columns' amaxes, scales and codes, each loop running along a row.
void quantize_column_blocks(const float* v, int64_t rows, int64_t cols, int64_t br,
                            const BlockFormat& format, float s_enc,
                            const c10::optional<StochasticRounding>& stochastic, uint64_t key,
                            uint8_t* codes, char* scales, size_t scale_bytes) {
  const ElementFormat element = format.element();
  at::parallel_for(0, blocks_over(rows, br), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> amax(static_cast<size_t>(cols)), factor(static_cast<size_t>(cols));
    std::vector<uint8_t> nan(static_cast<size_t>(cols));
    for (int64_t bi = begin; bi < end; ++bi) {
      const int64_t r0 = bi * br, r1 = std::min(rows, r0 + br);
      std::fill(amax.begin(), amax.end(), 0.0f);
      std::fill(nan.begin(), nan.end(), 0);
      for (int64_t r = r0; r < r1; ++r) {
        const float* row = v + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          const float a = std::fabs(row[c]);
          nan[c] |= a != a;
          amax[c] = a > amax[c] ? a : amax[c];
        }
      }
      for (int64_t c = 0; c < cols; ++c) {
        const float m = nan[c] ? std::numeric_limits<float>::quiet_NaN() : amax[c];
        factor[c] = scale_of_block(m, format, s_enc, scales + (bi * cols + c) * scale_bytes).encode;
      }
      for (int64_t r = r0; r < r1; ++r) {
        const float* row = v + r * cols;
        uint8_t* out_row = codes + r * cols;
        if (stochastic) {
          const uint64_t first = stochastic->offset + static_cast<uint64_t>(r * cols);
          with_stochastic_encoder(element, [&](auto encode) {
            for (int64_t c = 0; c < cols; ++c) {
              out_row[c] =
                  encode(row[c] * factor[c], stream_bits(key, first + static_cast<uint64_t>(c)));
            }
          });
        } else {
          with_encoder(element, [&](auto encode) {
            for (int64_t c = 0; c < cols; ++c) out_row[c] = encode(row[c] * factor[c]);
          });
        }
      }
    }
  });
}

}  // namespace

BlockTensor BlockTensor::quantize(const at::Tensor& x, const BlockFormat& format,
                                  const c10::optional<StochasticRounding>& stochastic) {
  check_block_input(x, format, "BlockTensor::quantize");
  const at::Tensor values = x.to(at::kFloat).contiguous();
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  const int64_t br = format.block_rows(), bc = format.block_cols();
  auto scale_sizes = x.sizes().vec();
  scale_sizes.back() = blocks_over(cols, bc);
  if (br > 1) scale_sizes.front() = blocks_over(rows, br);
  const bool fp32_scales =
      format.rule() == ScaleRule::kFloat32 || format.rule() == ScaleRule::kFloat32Pow2;
  BlockTensor out;
  out.format = format;
  out.codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  out.scales = at::empty(scale_sizes, x.options().dtype(fp32_scales ? at::kFloat : at::kByte));
  float s_enc = 1.0f;
  const float* v = values.data_ptr<float>();
  if (format.rule() == ScaleRule::kNvfp4) {
    out.global_amax = at::parallel_reduce(
        0, values.numel(), ampx::detail::kElementwiseGrain, 0.0f,
        [&](int64_t begin, int64_t end, float m) {
          bool nan = false;
          for (int64_t i = begin; i < end; ++i) {
            const float a = std::fabs(v[i]);
            nan |= a != a;
            m = a > m ? a : m;
          }
          return nan ? std::numeric_limits<float>::quiet_NaN() : m;
        },
        [](float a, float b) { return a != a || b != b ? std::numeric_limits<float>::quiet_NaN()
                                                      : std::max(a, b); });
    s_enc = nvfp4_encode_scale(out.global_amax);
  }
  const uint64_t key = stochastic ? stream_key(stochastic->seed) : 0;
  uint8_t* codes = out.codes.data_ptr<uint8_t>();
  char* scales = static_cast<char*>(out.scales.data_ptr());
  const size_t scale_bytes = out.scales.element_size();
  const int64_t nbr = blocks_over(rows, br), nbc = blocks_over(cols, bc);
  const ElementFormat element = format.element();
  if (bc == 1 && br > 1) {
    // Blocks down the columns (a product along the rows: TE's column-wise
    // copy, in place): each pass over a block row is contiguous in memory.
    quantize_column_blocks(v, rows, cols, br, format, s_enc, stochastic, key, codes, scales,
                           scale_bytes);
    return out;
  }
  at::parallel_for(0, nbr, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bi = begin; bi < end; ++bi) {
      const int64_t r0 = bi * br, r1 = std::min(rows, r0 + br);
      for (int64_t bj = 0; bj < nbc; ++bj) {
        const int64_t c0 = bj * bc, c1 = std::min(cols, c0 + bc);
        float amax = 0.0f;
        bool nan = false;
        for (int64_t r = r0; r < r1; ++r) {
          const float* row = v + r * cols;
          for (int64_t c = c0; c < c1; ++c) {
            const float a = std::fabs(row[c]);
            nan |= a != a;
            amax = a > amax ? a : amax;
          }
        }
        if (nan) amax = std::numeric_limits<float>::quiet_NaN();
        const BlockScale s =
            scale_of_block(amax, format, s_enc, scales + (bi * nbc + bj) * scale_bytes);
        for (int64_t r = r0; r < r1; ++r) {
          const float* row = v + r * cols;
          uint8_t* out_row = codes + r * cols;
          if (stochastic) {
            const uint64_t first = stochastic->offset + static_cast<uint64_t>(r * cols);
            with_stochastic_encoder(element, [&](auto encode) {
              for (int64_t c = c0; c < c1; ++c) {
                out_row[c] = encode(row[c] * s.encode,
                                    stream_bits(key, first + static_cast<uint64_t>(c)));
              }
            });
          } else {
            with_encoder(element, [&](auto encode) {
              for (int64_t c = c0; c < c1; ++c) out_row[c] = encode(row[c] * s.encode);
            });
          }
        }
      }
    }
  });
  return out;
}

at::Tensor BlockTensor::block_values() const {
  const bool fp32_scales =
      format.rule() == ScaleRule::kFloat32 || format.rule() == ScaleRule::kFloat32Pow2;
  TORCH_CHECK_VALUE(codes.defined() && scales.defined() && codes.scalar_type() == at::kByte &&
                        codes.device().is_cpu() && codes.dim() >= 1 &&
                        scales.scalar_type() == (fp32_scales ? at::kFloat : at::kByte),
                    "ampx::fp8::BlockTensor: codes must be uint8 CPU tensors and scales ",
                    fp32_scales ? "float32" : "uint8", " for ", format.to_string());
  const int64_t cols = codes.size(-1), rows = cols == 0 ? 0 : codes.numel() / cols;
  const int64_t br = format.block_rows(), bc = format.block_cols();
  const int64_t nbr = blocks_over(rows, br), nbc = blocks_over(cols, bc);
  TORCH_CHECK_VALUE(scales.numel() == nbr * nbc, "ampx::fp8::BlockTensor: ", scales.numel(),
                    " scales for codes ", codes.sizes(), " in blocks of ", br, " x ", bc,
                    " (want ", nbr * nbc, ")");
  const at::Tensor c = codes.contiguous(), s = scales.contiguous();
  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  const std::array<float, 256> table = decode_table(format.element());
  const uint8_t* cp = c.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  std::vector<float> block_scale(static_cast<size_t>(nbr * nbc));
  for (int64_t b = 0; b < nbr * nbc; ++b) {
    if (fp32_scales) {
      block_scale[b] = s.data_ptr<float>()[b];
    } else {
      const uint8_t byte = s.data_ptr<uint8_t>()[b];
      block_scale[b] = format.rule() == ScaleRule::kNvfp4 ? decode(byte, Fp8Format::kE4M3)
                                                          : scale_value(byte);
    }
  }
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row_scales = block_scale.data() + (r / br) * nbc;
      const uint8_t* in = cp + r * cols;
      float* o = op + r * cols;
      for (int64_t j = 0; j < nbc; ++j) {
        const float scale = row_scales[j];
        for (int64_t c = j * bc, end_c = std::min(cols, c + bc); c < end_c; ++c) {
          o[c] = table[in[c]] * scale;
        }
      }
    }
  });
  return out;
}

float BlockTensor::tensor_scale() const {
  return format.rule() == ScaleRule::kNvfp4 ? global_amax / (6.0f * 448.0f) : 1.0f;
}

at::Tensor BlockTensor::dequantize(c10::ScalarType out_dtype) const {
  TORCH_CHECK_VALUE(out_dtype == at::kFloat || out_dtype == at::kBFloat16 ||
                        out_dtype == at::kHalf,
                    "ampx::fp8::BlockTensor::dequantize: out_dtype must be float32, bfloat16 or "
                    "float16, got ",
                    out_dtype);
  at::Tensor values = block_values();
  if (format.rule() == ScaleRule::kNvfp4) values.mul_(tensor_scale());
  return values.to(out_dtype);
}

BlockTensor BlockTensor::transposed() const {
  TORCH_CHECK_VALUE(codes.dim() == 2 && format.block_rows() > 1,
                    "ampx::fp8::BlockTensor::transposed: takes a 2-D tensor in 2-D blocks, got ",
                    codes.sizes(), " in blocks of ", format.block_rows(), " x ",
                    format.block_cols());
  BlockTensor t = *this;
  t.codes = codes.t().contiguous();
  t.scales = scales.t().contiguous();
  t.format.block_rows(format.block_cols()).block_cols(format.block_rows());
  return t;
}

at::Tensor block_scaled_mm(const BlockTensor& a, const BlockTensor& b) {
  TORCH_CHECK_VALUE(a.codes.dim() == 2 && b.codes.dim() == 2 && a.codes.size(1) == b.codes.size(1),
                    "ampx::fp8::block_scaled_mm: a [M, K] and b [N, K], got ", a.codes.sizes(),
                    " and ", b.codes.sizes());
  at::Tensor y = at::mm(a.block_values(), b.block_values().t());
  const float alpha = detail::product_scale(a, b);
  if (alpha != 1.0f) y.mul_(alpha);
  return y;
}

float detail::product_scale(const BlockTensor& a, const BlockTensor& b) {
  if (a.format.rule() == ScaleRule::kNvfp4 && b.format.rule() == ScaleRule::kNvfp4) {
    // TE's alpha: amax_A * amax_B / (6 * 6 * 448 * 448), in float32.
    return a.global_amax * b.global_amax * (1.0f / (6.0f * 6.0f * 448.0f * 448.0f));
  }
  return a.tensor_scale() * b.tensor_scale();
}

at::Tensor hadamard16(const at::Tensor& x, bool inverse, int64_t dim) {
  const bool columns = dim == 0;
  TORCH_CHECK_VALUE(x.defined() && (dim == -1 || (columns && x.dim() == 2)),
                    "ampx::fp8::hadamard16: dim must be -1, or 0 of a 2-D tensor, got ", dim,
                    " for ", x.defined() ? x.sizes() : at::IntArrayRef{});
  const int64_t along = columns ? 0 : x.dim() - 1;
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(along) % 16 == 0, "ampx::fp8::hadamard16: dimension ",
                    along, " must be a multiple of 16, got ", x.sizes());
  // TE's get_wgrad_sign_vector (torchao's DEFAULT_SIGN_VECTOR).
  static const float kSigns[16] = {1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1};
  at::Tensor h = at::empty({16, 16}, at::kFloat);
  auto ha = h.accessor<float, 2>();
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 16; ++j) {
      // Sylvester: H16[i][j] = (-1)^popcount(i & j); H = S H16 / 4.
      ha[i][j] = kSigns[i] * (std::popcount(static_cast<unsigned>(i & j)) % 2 ? -0.25f : 0.25f);
    }
  }
  h = h.to(x.device());
  const at::Tensor m = inverse ? h.t() : h;
  if (columns) {
    // Each column tile c (16 rows) as a row vector: (c^T m)^T = m^T c.
    const at::Tensor tiles = x.to(at::kFloat).reshape({x.size(0) / 16, 16, x.size(1)});
    return at::matmul(m.t(), tiles).reshape(x.sizes());
  }
  const at::Tensor tiles = x.to(at::kFloat).reshape({-1, 16});
  return at::mm(tiles, m).view(x.sizes());
}

at::Tensor pack_fp4(const at::Tensor& codes) {
  TORCH_CHECK_VALUE(codes.defined() && codes.scalar_type() == at::kByte && codes.dim() >= 1 &&
                        codes.size(-1) % 2 == 0,
                    "ampx::fp8::pack_fp4: codes must be uint8 with an even last dimension, got ",
                    codes.defined() ? c10::toString(codes.scalar_type()) : "undefined", " ",
                    codes.sizes());
  const at::Tensor pairs = codes.reshape({-1, 2});
  const at::Tensor low = pairs.select(1, 0).bitwise_and(0x0F);
  const at::Tensor high = pairs.select(1, 1).bitwise_and(0x0F);
  auto sizes = codes.sizes().vec();
  sizes.back() /= 2;
  return low.bitwise_or(high.__lshift__(4)).view(sizes);
}

at::Tensor unpack_fp4(const at::Tensor& packed) {
  TORCH_CHECK_VALUE(packed.defined() && packed.scalar_type() == at::kByte && packed.dim() >= 1,
                    "ampx::fp8::unpack_fp4: packed must be uint8, got ",
                    packed.defined() ? c10::toString(packed.scalar_type()) : "undefined");
  const at::Tensor low = packed.bitwise_and(0x0F), high = packed.__rshift__(4);
  auto sizes = packed.sizes().vec();
  sizes.back() *= 2;
  return at::stack({low, high}, -1).reshape(sizes);
}

}  // namespace fp8
}  // namespace ampx
