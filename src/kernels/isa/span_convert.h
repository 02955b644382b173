#pragma once

// Widening and narrowing between 16-bit spans and float32 buffers, for the
// span kernels compiled once per instruction set (norm_span.cpp,
// activation_span.cpp). Include from a file compiled with CPU_CAPABILITY
// defined: the functions live in that build's namespace.

#include <ATen/cpu/vec/vec.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <tuple>

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {

using at::vec::Vectorized;
using FVec = Vectorized<float>;

// src[0, n) of `dtype` -> float32 dst.
inline void widen(const void* src, c10::ScalarType dtype, float* dst, int64_t n) {
  if (dtype == c10::kBFloat16) {
    using BVec = Vectorized<c10::BFloat16>;
    const auto* p = static_cast<const c10::BFloat16*>(src);
    int64_t i = 0;
    for (; i + BVec::size() <= n; i += BVec::size()) {
      FVec lo, hi;
      std::tie(lo, hi) = at::vec::convert_bfloat16_float(BVec::loadu(p + i));
      lo.store(dst + i);
      hi.store(dst + i + FVec::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(p[i]);
  } else if (dtype == c10::kHalf) {
    const auto* p = static_cast<const c10::Half*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(p[i]);
  } else {
    const auto* p = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = p[i];
  }
}

// float32 src[0, n) -> dst of `dtype`, rounded to nearest even.
inline void narrow(const float* src, void* dst, c10::ScalarType dtype, int64_t n) {
  if (dtype == c10::kBFloat16) {
    using BVec = Vectorized<c10::BFloat16>;
    auto* p = static_cast<c10::BFloat16*>(dst);
    int64_t i = 0;
    for (; i + BVec::size() <= n; i += BVec::size()) {
      at::vec::convert_float_bfloat16(FVec::loadu(src + i), FVec::loadu(src + i + FVec::size()))
          .store(p + i);
    }
    for (; i < n; ++i) p[i] = static_cast<c10::BFloat16>(src[i]);
  } else if (dtype == c10::kHalf) {
    auto* p = static_cast<c10::Half*>(dst);
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<c10::Half>(src[i]);
  } else {
    auto* p = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) p[i] = src[i];
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
