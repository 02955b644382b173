// Non-finite check + unscale on the CPU, one pass over each gradient: the
// driver. It cuts all gradients into chunks (multi-tensor style, so many
// small grads parallelise as well as one big one) and runs the per-ISA span
// kernel of kernels/cpu/unscale_span.cpp on them with at::parallel_for.

#include "ampx/detail/kernels.h"

#include "isa/isa_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

namespace ampx {
namespace detail {
namespace cpu {
namespace {

// A span of one gradient; the unit of parallel work.
struct Chunk {
  void* data;
  int64_t begin;
  int64_t end;
  c10::ScalarType dtype;
};

constexpr int64_t kChunkElems = 1 << 16;        // 256 KiB of fp32: fits L2
constexpr int64_t kSerialBelowElems = 1 << 15;  // at::internal::GRAIN_SIZE

}  // namespace

void non_finite_check_and_unscale_(at::TensorList grads, at::Tensor& found_inf,
                                   const at::Tensor& inv_scale) {
  non_finite_check_and_unscale_(grads, found_inf, inv_scale, best_isa());
}

void non_finite_check_and_unscale_(at::TensorList grads, at::Tensor& found_inf,
                                   const at::Tensor& inv_scale, Isa isa) {
  const UnscaleSpanFn span = unscale_span_for(isa);
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
      bad |= span(c.data, c.dtype, c.begin, c.end, inv);
    }
  } else {
    std::atomic<bool> any_bad{false};
    at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
      bool local = false;
      for (int64_t c = begin; c < end; ++c) {
        local |= span(chunks[c].data, chunks[c].dtype, chunks[c].begin, chunks[c].end, inv);
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
