// Non-finite check + unscale on the CPU, one pass over each gradient: the
// driver. It cuts all gradients into chunks (kernels/cpu/chunks.h: many
// small grads parallelise as well as one big one) and runs the per-ISA span
// kernel of kernels/isa/unscale_span.cpp on them.

#include "ampx/detail/kernels.h"

#include "cpu/chunks.h"
#include "isa/unscale_kernels.h"

#include <ATen/ATen.h>

#include <atomic>
#include <vector>

namespace ampx {
namespace detail {
namespace cpu {

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

  // numels[i]: elements of grads[i] the span kernel walks (0: none).
  std::vector<int64_t> numels(grads.size(), 0);
  bool bad = false;
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
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
    numels[i] = g.numel();
  }

  std::atomic<bool> any_bad{false};
  for_each_chunk(numels, kChunkElems, [&](int64_t, int64_t i, int64_t begin, int64_t end) {
    if (span(grads[i].data_ptr(), grads[i].scalar_type(), begin, end, inv)) {
      any_bad.store(true, std::memory_order_relaxed);
    }
  });
  if (bad || any_bad.load()) {
    *found_inf.data_ptr<float>() = 1.f;
  }
}

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
