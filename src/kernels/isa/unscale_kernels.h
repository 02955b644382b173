#pragma once

// The unscale span kernel (unscale_span.cpp), one per instruction set: each
// file in src/kernels/isa/ is compiled once per ISA with CPU_CAPABILITY set to
// DEFAULT, AVX2 or AVX512, which names both at::vec's inline namespace and the
// namespaces declared here. (The optimizer kernels: optim_kernels.h.)

#include "isa_dispatch.h"

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace ampx {
namespace detail {
namespace cpu {

#define AMPX_DECLARE_ISA_KERNELS(ns)                                                      \
  namespace ns {                                                                          \
  /* data[begin, end) *= inv in place; true if any element was inf/NaN. */                \
  bool unscale_span(void* data, c10::ScalarType dtype, int64_t begin, int64_t end,        \
                    float inv);                                                           \
  }
AMPX_DECLARE_ISA_KERNELS(DEFAULT)
AMPX_DECLARE_ISA_KERNELS(AVX2)
AMPX_DECLARE_ISA_KERNELS(AVX512)
#undef AMPX_DECLARE_ISA_KERNELS

using UnscaleSpanFn = bool (*)(void*, c10::ScalarType, int64_t, int64_t, float);

#define AMPX_UNSCALE_BUILD(ns) &ns::unscale_span
AMPX_ISA_DISPATCH(UnscaleSpanFn, unscale_span_for, AMPX_UNSCALE_BUILD)
#undef AMPX_UNSCALE_BUILD

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
