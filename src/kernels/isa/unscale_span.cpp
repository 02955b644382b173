// The per-element part of non-finite check + unscale, compiled once per
// instruction set (see unscale_kernels.h). The driver in cpu_unscale.cpp splits
// the gradients into chunks and calls unscale_span on each.
//
// Finiteness is tracked without branches: for finite x, x - x == 0; for inf
// or NaN it is NaN, and NaN survives addition. Each span accumulates
// acc += (x - x) next to the multiply and inspects acc once at its end, so
// the check costs two vector ops per load and the loop stays memory bound.

#include "unscale_kernels.h"

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <tuple>

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// Returns true if any element of data[begin, end) is not finite.
template <class T>
bool unscale_span_vec(T* data, int64_t begin, int64_t end, T inv) {
  using Vec = Vectorized<T>;
  const Vec vinv(inv);
  Vec acc(T(0));
  int64_t i = begin;
  for (; i + Vec::size() <= end; i += Vec::size()) {
    const Vec x = Vec::loadu(data + i);
    acc = acc + (x - x);
    (x * vinv).store(data + i);
  }
  bool bad = false;
  T lanes[Vec::size()];
  acc.store(lanes);
  for (int64_t l = 0; l < Vec::size(); ++l) {
    bad |= std::isnan(lanes[l]);
  }
  for (; i < end; ++i) {
    bad |= !std::isfinite(data[i]);
    data[i] *= inv;
  }
  return bad;
}

// bfloat16 grads: widen to float, multiply in float (as ATen does), narrow
// back with round-to-nearest-even.
bool unscale_span_bf16(c10::BFloat16* data, int64_t begin, int64_t end, float inv) {
  using BVec = Vectorized<c10::BFloat16>;
  using FVec = Vectorized<float>;
  const FVec vinv(inv);
  FVec acc(0.f);
  int64_t i = begin;
  for (; i + BVec::size() <= end; i += BVec::size()) {
    const BVec x = BVec::loadu(data + i);
    FVec lo, hi;
    std::tie(lo, hi) = at::vec::convert_bfloat16_float(x);
    acc = acc + (lo - lo) + (hi - hi);
    at::vec::convert_float_bfloat16(lo * vinv, hi * vinv).store(data + i);
  }
  bool bad = false;
  float lanes[FVec::size()];
  acc.store(lanes);
  for (int64_t l = 0; l < FVec::size(); ++l) {
    bad |= std::isnan(lanes[l]);
  }
  for (; i < end; ++i) {
    const float x = static_cast<float>(data[i]);
    bad |= !std::isfinite(x);
    data[i] = static_cast<c10::BFloat16>(x * inv);
  }
  return bad;
}

// float16 grads (rare on the CPU): widen per element; still one pass.
bool unscale_span_half(c10::Half* data, int64_t begin, int64_t end, float inv) {
  bool bad = false;
  for (int64_t i = begin; i < end; ++i) {
    const float x = static_cast<float>(data[i]);
    bad |= !std::isfinite(x);
    data[i] = static_cast<c10::Half>(x * inv);
  }
  return bad;
}

}  // namespace

bool unscale_span(void* data, c10::ScalarType dtype, int64_t begin, int64_t end, float inv) {
  switch (dtype) {
    case c10::kFloat:
      return unscale_span_vec(static_cast<float*>(data), begin, end, inv);
    case c10::kDouble:
      return unscale_span_vec(static_cast<double*>(data), begin, end, static_cast<double>(inv));
    case c10::kBFloat16:
      return unscale_span_bf16(static_cast<c10::BFloat16*>(data), begin, end, inv);
    case c10::kHalf:
      return unscale_span_half(static_cast<c10::Half*>(data), begin, end, inv);
    default:
      TORCH_INTERNAL_ASSERT(false, "unreachable: dtype checked before");
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
