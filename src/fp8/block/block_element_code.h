#pragma once

// The element formats of ampx/fp8/block.h as types, for the element loops of
// BlockTensor::quantize (block_tensor.cpp, cuda/block_kernels.cu) and
// encode_element_stochastic (block_elements.cpp): one switch over
// ElementFormat picks the format's block_math::ElementCode, whose constants
// are template arguments, so that a loop over elements is compiled once per
// format with no switch inside it.
//
//   with_element_code(ElementFormat::kE2M1, [&](auto encode) {
//     for (int64_t i = 0; i < n; ++i) out[i] = encode(x[i]);       // nearest even
//     for (int64_t i = 0; i < n; ++i) out[i] = encode(x[i], r[i]);  // stochastic
//   });

#include "ampx/fp8/block.h"

#include "../../core/float_formats.h"
#include "block_math.h"

#include <cstdint>
#include <type_traits>

namespace ampx {
namespace fp8 {
namespace detail {

/// The ElementCode of the format laid out as kSpec (src/core/float_formats.h);
/// kNan: a NaN element has a NaN code (FP8), not a signed zero (FP6, FP4).
template <const ampx::detail::FloatFormatSpec& kSpec, bool kNan>
using ElementCodeOf =
    block_math::ElementCode<kSpec.mantissa_bits, kSpec.bias,
                            1 + kSpec.exponent_bits + kSpec.mantissa_bits, kNan>;

static_assert(std::is_same_v<ElementCodeOf<ampx::detail::kE4M3, true>, block_math::E4M3Code> &&
                  std::is_same_v<ElementCodeOf<ampx::detail::kE5M2, true>, block_math::E5M2Code> &&
                  std::is_same_v<ElementCodeOf<ampx::detail::kE3M2, false>, block_math::E3M2Code> &&
                  std::is_same_v<ElementCodeOf<ampx::detail::kE2M3, false>, block_math::E2M3Code> &&
                  std::is_same_v<ElementCodeOf<ampx::detail::kE2M1, false>, block_math::E2M1Code>,
              "block_math's element codes must be the shared table's formats");

/// Calls fn(encode) with `format`'s ElementCode: the one dispatch on the
/// element format of the loops that write codes (on the CPU, and on the host
/// side of the CUDA launches).
template <class Fn>
void with_element_code(ElementFormat format, Fn&& fn) {
  const ElementLimits& l = limits(format);
  switch (format) {
    case ElementFormat::kE4M3:
      return fn(block_math::E4M3Code{l.max, l.max_code});
    case ElementFormat::kE5M2:
      return fn(block_math::E5M2Code{l.max, l.max_code});
    case ElementFormat::kE3M2:
      return fn(block_math::E3M2Code{l.max, l.max_code});
    case ElementFormat::kE2M3:
      return fn(block_math::E2M3Code{l.max, l.max_code});
    case ElementFormat::kE2M1:
      return fn(block_math::E2M1Code{l.max, l.max_code});
  }
}

}  // namespace detail
}  // namespace fp8
}  // namespace ampx
