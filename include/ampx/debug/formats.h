#pragma once

/// \file
/// The floating-point formats of mixed precision and their exact limits, for
/// the range statistics and the precision advisor. The limits are those of
/// PyTorch's `torch.finfo` (tests compare them with it); the rounding
/// boundaries follow from round-to-nearest-even, which is how every cast to
/// these formats rounds:
///
/// ```
///   const auto& f = ampx::debug::format(ampx::debug::Format::kFloat16);
///   f.max;               // 65504
///   f.overflow_from;     // 65520: |x| >= this rounds to inf
///   f.zero_up_to;        // 2^-25: 0 < |x| <= this rounds to 0
///   f.normal_from;       // 2^-14 - 2^-25: smaller |x| rounds to a subnormal (or 0)
/// ```
///
/// float8 e4m3fn has no inf: |x| > 464 rounds to its NaN unless the caller
/// saturates (clamps to 448) first, as FP8 recipes do. `overflow_inclusive`
/// says whether |x| == overflow_from itself overflows.

#include <array>
#include <cstdint>
#include <string>

namespace ampx {
namespace debug {

/// The 16- and 8-bit floating-point formats of mixed precision.
enum class Format {
  kFloat16,     ///< IEEE half: 5 exponent bits, 10 mantissa bits
  kBFloat16,    ///< bfloat16: float32's 8 exponent bits, 7 mantissa bits
  kFloat8E4M3,  ///< float8 e4m3fn: 4 exponent bits, 3 mantissa bits, no inf
  kFloat8E5M2,  ///< float8 e5m2: 5 exponent bits, 2 mantissa bits
};

/// Every Format, in the order per-format arrays (RangeRecord::formats,
/// PrecisionAdvice::formats) are indexed.
inline constexpr std::array<Format, 4> kAllFormats = {Format::kFloat16, Format::kBFloat16,
                                                      Format::kFloat8E4M3, Format::kFloat8E5M2};

/// The exact limits of one format (the top of this header shows float16's).
struct FormatLimits {
  Format format;            ///< the format these are the limits of
  const char* name;         ///< "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"
  int mantissa_bits;        ///< explicit mantissa bits: 10, 7, 3, 2
  float max;                ///< largest finite value (finfo.max)
  float min_normal;         ///< smallest positive normal (finfo.tiny / smallest_normal)
  float min_subnormal;      ///< smallest positive subnormal
  float overflow_from;      ///< |x| at or beyond this does not fit (see overflow_inclusive)
  bool overflow_inclusive;  ///< whether |x| == overflow_from overflows (ties to even)
  float zero_up_to;         ///< 0 < |x| <= this rounds to zero: min_subnormal / 2
  float normal_from;        ///< |x| below this (and above zero_up_to) becomes subnormal
};

/// The limits of `format`.
const FormatLimits& format(Format format);

/// "float16", ...
std::string to_string(Format format);

}  // namespace debug
}  // namespace ampx
