// Non-finite check + unscale on the CPU, one pass over each gradient.
//
// Finiteness is tracked without branches: for finite x, x - x == 0; for inf
// or NaN it is NaN, and NaN survives addition. Each chunk accumulates
// acc += (x - x) next to the multiply and inspects acc once at its end, so
// the check costs two vector ops per load and the loop stays memory bound.

#include "ampx/detail/kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace ampx {
namespace detail {
namespace cpu {
namespace {

using at::vec::Vectorized;

// A span of one gradient; the unit of parallel work.
struct Chunk {
  void* data;
  int64_t begin;
  int64_t end;
  c10::ScalarType dtype;
};

constexpr int64_t kChunkElems = 1 << 16;      // 256 KiB of fp32: fits L2
constexpr int64_t kSerialBelowElems = 1 << 15;  // at::internal::GRAIN_SIZE

// Returns true if any element of data[begin, end) is not finite.
template <class T>
bool unscale_span(T* data, int64_t begin, int64_t end, T inv) {
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
bool unscale_span(c10::BFloat16* data, int64_t begin, int64_t end, float inv) {
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
bool unscale_span(c10::Half* data, int64_t begin, int64_t end, float inv) {
  bool bad = false;
  for (int64_t i = begin; i < end; ++i) {
    const float x = static_cast<float>(data[i]);
    bad |= !std::isfinite(x);
    data[i] = static_cast<c10::Half>(x * inv);
  }
  return bad;
}

bool run_chunk(const Chunk& c, float inv) {
  switch (c.dtype) {
    case c10::kFloat:
      return unscale_span(static_cast<float*>(c.data), c.begin, c.end, inv);
    case c10::kDouble:
      return unscale_span(static_cast<double*>(c.data), c.begin, c.end, static_cast<double>(inv));
    case c10::kBFloat16:
      return unscale_span(static_cast<c10::BFloat16*>(c.data), c.begin, c.end, inv);
    case c10::kHalf:
      return unscale_span(static_cast<c10::Half*>(c.data), c.begin, c.end, inv);
    default:
      TORCH_INTERNAL_ASSERT(false, "unreachable: dtype checked before");
  }
}

}  // namespace

void non_finite_check_and_unscale_(at::TensorList grads, at::Tensor& found_inf,
                                   const at::Tensor& inv_scale) {
  check_unscale_args(grads, found_inf, inv_scale);
  TORCH_CHECK(found_inf.device().is_cpu(), "ampx::detail::cpu::non_finite_check_and_unscale_: ",
              "found_inf must be a CPU tensor, got ", found_inf.device());
  const float inv = *inv_scale.data_ptr<float>();

  std::vector<Chunk> chunks;
  int64_t total = 0;
  bool bad = false;
  for (const auto& g : grads) {
    if (g.numel() == 0) {
      continue;
    }
    if (!g.is_non_overlapping_and_dense()) {
      // Overlapping or gapped views have no flat span; let ATen walk them.
      bad |= at::isfinite(g).all().logical_not().item<bool>();
      g.mul_(inv_scale);
      continue;
    }
    // Dense in some order: the storage span is exactly numel elements.
    for (int64_t b = 0; b < g.numel(); b += kChunkElems) {
      chunks.push_back({g.data_ptr(), b, std::min(b + kChunkElems, g.numel()), g.scalar_type()});
    }
    total += g.numel();
  }

  if (total < kSerialBelowElems) {
    for (const auto& c : chunks) {
      bad |= run_chunk(c, inv);
    }
  } else {
    std::atomic<bool> any_bad{false};
    at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
      bool local = false;
      for (int64_t c = begin; c < end; ++c) {
        local |= run_chunk(chunks[c], inv);
      }
      if (local) {
        any_bad.store(true, std::memory_order_relaxed);
      }
    });
    bad |= any_bad.load();
  }
  if (bad) {
    *found_inf.data_ptr<float>() = 1.f;
  }
}

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
