// Block-scaled formats (ampx/fp8/block.h): element codes, E8M0 scale rules,
// MxTensor's casts and FP4 packing, on the CPU.

#include "ampx/fp8/block.h"

#include "ampx/fp8/cast.h"

#include "../float_formats.h"
#include "element_code.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <bit>
#include <cmath>
#include <limits>

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
  }
  return "?";
}

uint8_t encode_element(float value, ElementFormat format) {
  return is_fp8(format) ? encode(value, fp8_format(format)) : encode_small(value, limits(format));
}

float decode_element(uint8_t code, ElementFormat format) {
  return is_fp8(format) ? decode(code, fp8_format(format)) : decode_small(code, limits(format));
}

uint8_t scale_byte(float amax, ElementFormat format, ScaleRule rule) {
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

MxTensor MxTensor::quantize(const at::Tensor& x, ElementFormat format, ScaleRule rule,
                            int64_t block_size) {
  TORCH_CHECK_VALUE(x.defined() && x.device().is_cpu(),
                    "ampx::fp8::MxTensor::quantize: x must be a CPU tensor, got ",
                    x.defined() ? x.device().str() : std::string("an undefined tensor"));
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                        x.scalar_type() == at::kHalf,
                    "ampx::fp8::MxTensor::quantize: x must be float32, bfloat16 or float16, got ",
                    x.scalar_type());
  TORCH_CHECK_VALUE(block_size > 0, "ampx::fp8::MxTensor::quantize: block_size must be > 0, got ",
                    block_size);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) % block_size == 0,
                    "ampx::fp8::MxTensor::quantize: the last dimension of x ", x.sizes(),
                    " must be a multiple of block_size ", block_size);
  const at::Tensor values = x.to(at::kFloat).contiguous();
  auto scale_sizes = x.sizes().vec();
  scale_sizes.back() /= block_size;
  MxTensor out;
  out.codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  out.scales = at::empty(scale_sizes, x.options().dtype(at::kByte));
  out.format = format;
  out.rule = rule;
  out.block_size = block_size;
  const float* v = values.data_ptr<float>();
  uint8_t* codes = out.codes.data_ptr<uint8_t>();
  uint8_t* scales = out.scales.data_ptr<uint8_t>();
  const int64_t blocks = out.scales.numel();
  at::parallel_for(0, blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* block = v + b * block_size;
      float amax = 0.0f;
      bool nan = false;
      for (int64_t i = 0; i < block_size; ++i) {
        const float a = std::fabs(block[i]);
        nan = nan || std::isnan(a);
        amax = std::max(amax, a);
      }
      const uint8_t byte = scale_byte(nan ? std::numeric_limits<float>::quiet_NaN() : amax,
                                      format, rule);
      scales[b] = byte;
      // x / 2^s: the same float32 as x * 2^-s (torchao's RCEIL and TE
      // multiply by the reciprocal, its other rules divide); byte 0's 2^-127
      // is a subnormal, divided by as it is.
      const float scale = scale_value(byte);
      for (int64_t i = 0; i < block_size; ++i) {
        codes[b * block_size + i] = encode_element(block[i] / scale, format);
      }
    }
  });
  return out;
}

at::Tensor MxTensor::dequantize(c10::ScalarType out_dtype) const {
  TORCH_CHECK_VALUE(out_dtype == at::kFloat || out_dtype == at::kBFloat16 ||
                        out_dtype == at::kHalf,
                    "ampx::fp8::MxTensor::dequantize: out_dtype must be float32, bfloat16 or "
                    "float16, got ",
                    out_dtype);
  TORCH_CHECK_VALUE(codes.defined() && scales.defined() && codes.scalar_type() == at::kByte &&
                        scales.scalar_type() == at::kByte && codes.device().is_cpu() &&
                        codes.numel() == scales.numel() * block_size,
                    "ampx::fp8::MxTensor::dequantize: codes and scales must be uint8 CPU "
                    "tensors with block_size (", block_size, ") codes per scale");
  const at::Tensor c = codes.contiguous(), s = scales.contiguous();
  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const uint8_t* sp = s.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t bs = block_size;
  const ElementFormat f = format;
  at::parallel_for(0, s.numel(), 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float scale = scale_value(sp[b]);
      for (int64_t i = 0; i < bs; ++i) op[b * bs + i] = decode_element(cp[b * bs + i], f) * scale;
    }
  });
  return out.to(out_dtype);
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
