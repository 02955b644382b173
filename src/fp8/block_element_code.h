#pragma once

// The element formats of ampx/fp8/block.h as types, for the element loops of
// BlockTensor::quantize (block_tensor.cpp) and encode_element_stochastic
// (block_elements.cpp): one switch over ElementFormat picks the format's
// ElementCode, whose constants are template arguments, so that a loop over
// elements is compiled once per format with no switch inside it.
//
//   with_element_code(ElementFormat::kE2M1, [&](auto encode) {
//     for (int64_t i = 0; i < n; ++i) out[i] = encode(x[i]);       // nearest even
//     for (int64_t i = 0; i < n; ++i) out[i] = encode(x[i], r[i]);  // stochastic
//   });

#include "ampx/fp8/block.h"

#include "../core/float_formats.h"
#include "element_code.h"

#include <cstdint>

namespace ampx {
namespace fp8 {
namespace detail {

/// Every code's magnitude in `format` (codes above +max: 0), the table of
/// stochastic rounding's neighbours; built once.
const float* element_values(ElementFormat format);

/// The element code of the format laid out as kSpec (src/core/float_formats.h);
/// kNan: a NaN element has a NaN code (FP8), not a signed zero (FP6, FP4).
template <const ampx::detail::FloatFormatSpec& kSpec, bool kNan>
struct ElementCode {
  static constexpr int kBits = 1 + kSpec.exponent_bits + kSpec.mantissa_bits;

  float max;            // the largest magnitude
  uint32_t max_code;    // its code
  const float* values;  // element_values(format)

  /// y's code, rounded to nearest even (encode_branchless).
  uint8_t operator()(float y) const {
    return encode_branchless<kSpec.mantissa_bits, kSpec.bias, kBits, kNan>(y, max, max_code);
  }
  /// y's code, rounded up or down by `random` (encode_stochastic_branchless).
  uint8_t operator()(float y, uint32_t random) const {
    return encode_stochastic_branchless<kSpec.mantissa_bits, kSpec.bias, kBits, kNan>(
        y, max, max_code, values, random);
  }
};

/// Calls fn(encode) with `format`'s ElementCode: the one dispatch on the
/// element format of the loops that write codes.
template <class Fn>
void with_element_code(ElementFormat format, Fn&& fn) {
  const ElementLimits& l = limits(format);
  const float* values = element_values(format);
  switch (format) {
    case ElementFormat::kE4M3:
      return fn(ElementCode<ampx::detail::kE4M3, true>{l.max, l.max_code, values});
    case ElementFormat::kE5M2:
      return fn(ElementCode<ampx::detail::kE5M2, true>{l.max, l.max_code, values});
    case ElementFormat::kE3M2:
      return fn(ElementCode<ampx::detail::kE3M2, false>{l.max, l.max_code, values});
    case ElementFormat::kE2M3:
      return fn(ElementCode<ampx::detail::kE2M3, false>{l.max, l.max_code, values});
    case ElementFormat::kE2M1:
      return fn(ElementCode<ampx::detail::kE2M1, false>{l.max, l.max_code, values});
  }
}

}  // namespace detail
}  // namespace fp8
}  // namespace ampx
