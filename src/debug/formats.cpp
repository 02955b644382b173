#include "ampx/debug/formats.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace ampx {
namespace debug {
namespace {

// Rounding boundaries under round-to-nearest-even (see formats.h): a value
// exactly halfway goes to the neighbour with an even mantissa. The largest
// finite value of fp16, bf16 and e5m2 has an odd mantissa (all ones), so the
// halfway point above it rounds up to inf; e4m3fn's 448 is even (0b110), so
// 464 stays 448 and only larger values reach its NaN encoding.
FormatLimits make(Format f, const char* name, int mantissa_bits, float max, int min_normal_exp,
                  float overflow_from, bool overflow_inclusive) {
  const float min_normal = std::ldexp(1.0f, min_normal_exp);
  const float min_subnormal = std::ldexp(1.0f, min_normal_exp - mantissa_bits);
  const float half_subnormal = min_subnormal / 2;
  return FormatLimits{f,
                      name,
                      mantissa_bits,
                      max,
                      min_normal,
                      min_subnormal,
                      overflow_from,
                      overflow_inclusive,
                      half_subnormal,
                      min_normal - half_subnormal};
}

const FormatLimits kLimits[] = {
    make(Format::kFloat16, "float16", 10, 65504.0f, -14, 65520.0f, true),
    make(Format::kBFloat16, "bfloat16", 7, std::ldexp(255.0f, 120), -126, std::ldexp(511.0f, 119),
         true),
    make(Format::kFloat8E4M3, "float8_e4m3fn", 3, 448.0f, -6, 464.0f, false),
    make(Format::kFloat8E5M2, "float8_e5m2", 2, 57344.0f, -14, 61440.0f, true),
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
