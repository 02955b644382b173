#include "ampx/debug/formats.h"
#include "../core/float_formats.h"

#include <c10/util/Exception.h>

namespace ampx {
namespace debug {
namespace {

// The constants are the shared table's (src/core/float_formats.h); the rounding
// boundaries follow from round-to-nearest-even: a value exactly halfway goes
// to the neighbour with an even mantissa. The largest finite value of fp16,
// bf16 and e5m2 has an odd mantissa (all ones), so the halfway point above it
// rounds up to inf; e4m3fn's 448 is even (0b110), so 464 stays 448 and only
// larger values reach its NaN encoding.
FormatLimits make_format_limits(Format f, const ampx::detail::FloatFormatSpec& spec) {
  const float half_subnormal = spec.min_subnormal() / 2;
  return FormatLimits{f,
                      spec.torch_name,
                      spec.mantissa_bits,
                      spec.max,
                      spec.min_normal(),
                      spec.min_subnormal(),
                      spec.overflow_from(),
                      spec.overflow_inclusive(),
                      half_subnormal,
                      spec.min_normal() - half_subnormal};
}

const FormatLimits kLimits[] = {
    make_format_limits(Format::kFloat16, ampx::detail::kFloat16),
    make_format_limits(Format::kBFloat16, ampx::detail::kBFloat16),
    make_format_limits(Format::kFloat8E4M3, ampx::detail::kE4M3),
    make_format_limits(Format::kFloat8E5M2, ampx::detail::kE5M2),
};

}  // namespace

const FormatLimits& format(Format f) {
  const auto i = static_cast<size_t>(f);
  TORCH_CHECK(i < sizeof(kLimits) / sizeof(kLimits[0]), "ampx::debug::format: unknown format ",
              static_cast<int>(f));
  return kLimits[i];
}

std::string to_string(Format f) {
  return format(f).name;
}

}  // namespace debug
}  // namespace ampx
