#pragma once

// The safetensors dtypes ampx writes and reads (ampx/safetensors.h), by
// their names in the format's header: the plain ones as LibTorch dtypes, the
// FP8 ones as uint8 codes with their format.

#include "ampx/fp8/cast.h"

#include <c10/core/ScalarType.h>

#include <bit>

namespace ampx {
namespace detail {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian bytes; ampx writes them as they are in memory");

/// A plain dtype: its name in the header and its LibTorch dtype.
struct SafetensorsDtype {
  const char* name;
  c10::ScalarType type;
};
inline constexpr SafetensorsDtype kSafetensorsDtypes[] = {
    {"F64", c10::kDouble}, {"F32", c10::kFloat}, {"F16", c10::kHalf},  {"BF16", c10::kBFloat16},
    {"I64", c10::kLong},   {"I32", c10::kInt},   {"I16", c10::kShort}, {"I8", c10::kChar},
    {"U8", c10::kByte},    {"BOOL", c10::kBool},
};

/// An FP8 dtype: one byte per element, read as uint8 codes with their format.
struct SafetensorsFp8Dtype {
  const char* name;
  fp8::Fp8Format format;
};
inline constexpr SafetensorsFp8Dtype kSafetensorsFp8Dtypes[] = {
    {"F8_E4M3", fp8::Fp8Format::kE4M3},
    {"F8_E5M2", fp8::Fp8Format::kE5M2},
};

}  // namespace detail
}  // namespace ampx
