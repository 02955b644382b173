// The block-scaled formats' elements (ampx/fp8/block.h): their limits, the
// casts of one element to and from its code (E4M3 and E5M2 are cast.h's,
// E3M2, E2M3 and E2M1 are element_code.h's arithmetic), and FP4 packing.

#include "ampx/fp8/block.h"

#include "ampx/fp8/cast.h"

#include "../../core/float_formats.h"
#include "../element_code.h"
#include "block_element_code.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <bit>
#include <cmath>

namespace ampx {
namespace fp8 {
namespace {

// The constants are the shared table's (src/core/float_formats.h).
constexpr ElementLimits element_limits(const char* name, const ampx::detail::FloatFormatSpec& s) {
  return {name,
          s.exponent_bits,
          s.mantissa_bits,
          s.bias,
          s.max,
          s.max_exponent(),
          static_cast<uint8_t>(s.max_bits()),
          1 + s.exponent_bits + s.mantissa_bits};
}

constexpr ElementLimits kLimits[] = {
    element_limits("e4m3", ampx::detail::kE4M3), element_limits("e5m2", ampx::detail::kE5M2),
    element_limits("e3m2", ampx::detail::kE3M2), element_limits("e2m3", ampx::detail::kE2M3),
    element_limits("e2m1", ampx::detail::kE2M1),
};

bool is_fp8(ElementFormat f) {
  return f == ElementFormat::kE4M3 || f == ElementFormat::kE5M2;
}

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
  const float value =
      detail::magnitude_value(code & ((1u << (l.bits - 1)) - 1), l.bias, l.mantissa_bits);
  return (code >> (l.bits - 1)) & 1 ? -value : value;
}

}  // namespace

const ElementLimits& limits(ElementFormat format) {
  return kLimits[static_cast<int>(format)];
}

std::string to_string(ElementFormat format) {
  return limits(format).name;
}

uint8_t encode_element(float value, ElementFormat format) {
  return is_fp8(format) ? encode(value, fp8_format(format)) : encode_small(value, limits(format));
}

uint8_t encode_element_stochastic(float value, ElementFormat format, uint32_t random) {
  uint8_t code = 0;
  detail::with_element_code(format, [&](auto encode) { code = encode(value, random); });
  return code;
}

float decode_element(uint8_t code, ElementFormat format) {
  return is_fp8(format) ? decode(code, fp8_format(format)) : decode_small(code, limits(format));
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
