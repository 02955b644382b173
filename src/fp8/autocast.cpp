#include "ampx/fp8/autocast.h"
#include "autocast_internal.h"
#include "convert_internal.h"
#include "scaling_internal.h"

#include "ampx/dist.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>

#include <exception>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ampx {
namespace fp8 {
namespace {

using PendingAmaxes = std::vector<std::pair<std::shared_ptr<TensorScaling>, at::Tensor>>;

}  // namespace

namespace detail {
// The innermost region on this thread. (Outside the anonymous namespace:
// Fp8AutocastGuard::Region, a member of a public class, holds one.)
struct RegionState {
  bool enabled = false;
  const dist::ProcessGroup* group = nullptr;
  WeightCasts weight_casts = WeightCasts::kEveryForward;
  PendingAmaxes* pending = nullptr;  // forward amaxes awaiting the group's reduction
  PendingAmaxes* local = nullptr;    // CUDA amaxes for the region's one update launch
  const void* owner = nullptr;       // the Fp8AutocastGuard::Region this state is
};
}  // namespace detail

namespace {
using detail::RegionState;
thread_local RegionState t_region;

// The states of `pending` once each, with their amaxes (a state cast twice:
// the larger one), in the order first cast; empties `pending`.
struct Merged {
  std::vector<std::shared_ptr<TensorScaling>> states;
  std::vector<at::Tensor> amaxes;
};
Merged merge(PendingAmaxes& pending) {
  Merged m;
  std::unordered_map<TensorScaling*, size_t> index;
  for (auto& [state, amax] : pending) {
    auto it = index.find(state.get());
    if (it == index.end()) {
      index.emplace(state.get(), m.states.size());
      m.states.push_back(state);
      m.amaxes.push_back(amax);
    } else {
      m.amaxes[it->second] = at::maximum(m.amaxes[it->second], amax);
    }
  }
  pending.clear();
  return m;
}

// Max-reduces the amaxes of `pending` over `group` in one all-reduce and
// records them; a state cast twice records the larger amax once.
void reduce_and_record(PendingAmaxes& pending, const dist::ProcessGroup& group) {
  if (pending.empty()) return;
  auto [states, amaxes] = merge(pending);
  at::Tensor all = at::cat(amaxes);
  group.all_reduce_max(all);
  for (size_t i = 0; i < states.size(); ++i) {
    amaxes[i] = all.slice(0, static_cast<int64_t>(i), static_cast<int64_t>(i) + 1);
  }
  detail::record_all(states, amaxes);  // on CUDA, every delayed state in one launch
}

// Output-gradient amaxes of the running backward, reduced (pending) or
// recorded in one update launch (local) when it ends.
struct BackwardPending {
  std::mutex mutex;
  PendingAmaxes pending;
  PendingAmaxes local;
  const dist::ProcessGroup* group = nullptr;
  bool queued = false;
};

// Records `pending` (no reduction): the CUDA delayed-scaling states' updates
// in one launch (detail::record_all).
void record_local(PendingAmaxes& pending) {
  if (pending.empty()) return;
  const Merged m = merge(pending);
  detail::record_all(m.states, m.amaxes);
}

thread_local bool t_in_backward = false;
BackwardPending& backward_pending() {
  static auto* p = new BackwardPending();
  return *p;
}

void flush_backward() {
  auto& b = backward_pending();
  PendingAmaxes pending, local;
  const dist::ProcessGroup* group = nullptr;
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    pending.swap(b.pending);
    local.swap(b.local);
    group = b.group;
    b.group = nullptr;
    b.queued = false;
  }
  record_local(local);
  if (group) reduce_and_record(pending, *group);
}

// Queues flush_backward at the end of the running backward (caller holds b.mutex).
void queue_flush(BackwardPending& b) {
  if (!b.queued) {
    b.queued = true;
    torch::autograd::Engine::get_default_engine().queue_callback(&flush_backward);
  }
}

void defer_backward(std::shared_ptr<TensorScaling> state, at::Tensor amax,
                    const dist::ProcessGroup* group) {
  auto& b = backward_pending();
  std::lock_guard<std::mutex> lock(b.mutex);
  TORCH_CHECK(b.group == nullptr || b.group == group,
              "ampx::fp8: one backward ran FP8 layers of regions with different "
              "amax_reduction_groups");
  b.group = group;
  b.pending.emplace_back(std::move(state), std::move(amax));
  queue_flush(b);
}

}  // namespace

namespace detail {

const dist::ProcessGroup* region_group() {
  return t_region.group;
}

WeightCasts region_weight_casts() {
  return t_region.weight_casts;
}

void defer_amax(std::shared_ptr<TensorScaling> state, at::Tensor amax,
                const dist::ProcessGroup* group) {
  if (t_region.pending != nullptr && t_region.group == group) {
    t_region.pending->emplace_back(std::move(state), std::move(amax));
  } else {  // backward: the region has ended, the backward's end reduces
    defer_backward(std::move(state), std::move(amax), group);
  }
}

bool defer_update(std::shared_ptr<TensorScaling> state, at::Tensor amax) {
  if (t_in_backward) {
    auto& b = backward_pending();
    std::lock_guard<std::mutex> lock(b.mutex);
    b.local.emplace_back(std::move(state), std::move(amax));
    queue_flush(b);
    return true;
  }
  if (t_region.local == nullptr) return false;
  t_region.local->emplace_back(std::move(state), std::move(amax));
  return true;
}

BackwardCasts::BackwardCasts() : previous_(t_in_backward) {
  t_in_backward = true;
}

BackwardCasts::~BackwardCasts() {
  t_in_backward = previous_;
}

}  // namespace detail

// ---- regions -----------------------------------------------------------------------

struct Fp8AutocastGuard::Region {
  RegionState previous;
  bool key_was_included = false;
  bool ended = false;
  PendingAmaxes pending;
  PendingAmaxes local;

  // This thread's state back to what it was before the region: local only.
  void restore() {
    ended = true;
    t_region = previous;
    c10::impl::tls_set_dispatch_key_included(detail::kFp8LinearKey, key_was_included);
  }
};

Fp8AutocastGuard::Fp8AutocastGuard(bool enabled)
    : Fp8AutocastGuard(Fp8AutocastOptions().enabled(enabled)) {}

Fp8AutocastGuard::Fp8AutocastGuard(const Fp8AutocastOptions& options)
    : region_(std::make_unique<Region>()) {
  if (options.enabled()) detail::register_linear_kernels();
  region_->previous = t_region;
  region_->key_was_included = c10::impl::tls_is_dispatch_key_included(detail::kFp8LinearKey);
  t_region.enabled = options.enabled();
  t_region.group = options.enabled() ? options.amax_reduction_group() : nullptr;
  t_region.weight_casts = options.enabled() ? options.weight_casts() : WeightCasts::kEveryForward;
  t_region.pending = t_region.group ? &region_->pending : nullptr;
  t_region.local = options.enabled() ? &region_->local : nullptr;
  t_region.owner = region_.get();
  c10::impl::tls_set_dispatch_key_included(detail::kFp8LinearKey, options.enabled());
}

void Fp8AutocastGuard::finish() {
  if (region_->ended) return;
  TORCH_CHECK(t_region.owner == region_.get(),
              "ampx::fp8::Fp8AutocastGuard::finish: this region is not the innermost one of "
              "this thread (finish the inner regions first)");
  const RegionState mine = t_region;
  region_->restore();
  record_local(region_->local);  // the CUDA states' updates: one launch
  // The forward amaxes of the region, reduced over the group.
  if (mine.group) reduce_and_record(region_->pending, *mine.group);
}

Fp8AutocastGuard::~Fp8AutocastGuard() {
  if (region_->ended) return;
  region_->restore();
  // The region's own updates (no collective): as finish() records them.
  try {
    record_local(region_->local);
  } catch (...) {  // a destructor must not throw; the CUDA error resurfaces at the next call
  }
  // No collective here (see the header): the region's forward amaxes are
  // dropped on this rank, as on every rank an exception leaves the region on.
  if (!region_->pending.empty() && std::uncaught_exceptions() == 0) {
    try {
      TORCH_WARN_ONCE(
          "ampx::fp8: an Fp8AutocastGuard with an amax_reduction_group ended without finish(); "
          "the forward amaxes of its region were not reduced or recorded");
    } catch (...) {  // a warning handler that throws: the destructor must not
    }
  }
}

bool is_fp8_enabled() {
  return t_region.enabled;
}

}  // namespace fp8
}  // namespace ampx
