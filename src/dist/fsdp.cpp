// FullyShardedDataParallel: each unit's flat spaces of parameters sharded
// over the ranks as fp32 masters; gathered in the compute dtype around the
// unit's forward and backward; gradients reduce-scattered per unit as the
// autograd engine accumulates them (ampx/fsdp.h).

#include "ampx/fsdp.h"

#include "fsdp_impl.h"
#include "process_group_impl.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ampx {
namespace dist {

namespace {

// Which FullyShardedDataParallel shards a module, for sharded_forward().
std::mutex g_registry_mutex;
std::unordered_map<const torch::nn::Module*, fsdp::Unit*> g_registry;

fsdp::Unit* unit_of(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  const auto it = g_registry.find(module);
  return it == g_registry.end() ? nullptr : it->second;
}

}  // namespace

#if defined(AMPX_WITH_DIST)

namespace fsdp {

/// Gives `t`'s storage room for its elements (again): a gather writes there.
void allocate_storage(const at::Tensor& t) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (storage->data_ptr().get() != nullptr && storage->nbytes() == bytes) return;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

/// Frees `t`'s storage; tensors saved for backward keep the storage object,
/// which the gather before backward fills again.
void release_storage(const at::Tensor& t) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

SideStreams SideStreams::on(c10::Device device) {
  const c10::impl::VirtualGuardImpl streams(device.type());
  return {streams.getStreamFromGlobalPool(device), streams.getStreamFromGlobalPool(device),
          nullptr};
}

std::shared_ptr<c10::Event> record_event(c10::Device device) {
  auto event = std::make_shared<c10::Event>(device.type());
  event->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  return event;
}

void current_stream_waits(const c10::Event& event) {
  const c10::Device device(event.device_type(), event.device_index());
  event.block(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
}

OnSideStream::OnSideStream(const c10::Stream* side) {
  if (side == nullptr) return;
  record_event(side->device())->block(*side);  // recorded on the current stream
  guard_.emplace(*side);
}

}  // namespace fsdp

using fsdp::size_in_bytes;
using fsdp::Space;
using fsdp::Unit;

namespace {

/// Where a space's gather lands: its codes or its dtype's elements.
at::Tensor& gather_target(Space& s) {
  return s.as_codes ? s.codes : s.gathered;
}

}  // namespace

void FullyShardedDataParallel::Impl::start_gather(Unit& u, bool forward) {
  if (u.state != Unit::State::kFree) return;
  auto& pg = detail::ProcessGroupAccess::impl(group);
  const fsdp::OnSideStream side(streams ? &streams->gather : nullptr);
  for (auto& s : u.spaces) {
    if (s.fp8) s.as_codes = fsdp::gather_as_codes(*this, u, s, forward);
  }
  fsdp::whole_amaxes(*this, u);
  // Every space's shard cast (with its collectives) first, then the
  // storage: a cast that fails leaves nothing of the unit made or counted.
  for (auto& s : u.spaces) {
    if (s.block && s.as_codes) {  // codes and scales, in the parts this call needs
      fsdp::quantize_block_shard(*this, s, forward);
    } else {
      // A copy also in the masters' dtype: a gather left in flight (a
      // prefetch no forward took) must not read a master the step writes.
      s.send = s.as_codes ? fsdp::cast_shard(*this, s)
                          : s.master.to(s.dtype, /*non_blocking=*/false, /*copy=*/true);
    }
  }
  for (auto& s : u.spaces) {
    if (s.block && s.as_codes) {
      fsdp::start_block_gather(*this, s);
      continue;
    }
    at::Tensor& target = gather_target(s);
    fsdp::allocate_storage(target);
    s.gather = pg.all_gather_async(target, s.send);
    bytes_communicated += size_in_bytes(target);
    gathered_bytes += size_in_bytes(target);
  }
  peak_gathered_bytes = std::max(peak_gathered_bytes, gathered_bytes);
  u.state = Unit::State::kGathering;
  if (!streams) return;
  // The gather stream waits for the collectives; finish_gather() makes the
  // compute stream wait for it. What they send is theirs until then.
  for (auto& s : u.spaces) {
    if (s.gather) pg.stream_wait(s.gather, "all-gather (parameters)");
    s.gather.reset();
    if (!s.block) continue;
    for (const auto& work : s.block->works) {
      pg.stream_wait(work, "all-gather (block codes and scales)");
    }
    s.block->works.clear();
  }
  u.gathered = fsdp::record_event(streams->gather.device());
}

void FullyShardedDataParallel::Impl::finish_gather(Unit& u, bool forward) {
  // Prefetched (or kept) otherwise than this call needs: a forward as its
  // FP8 region says, a backward as its forwards were.
  const auto other_way = [&](const Space& s) {
    if (!s.fp8) return false;
    const bool codes =
        forward ? fsdp::codes_wanted(*this, s) : s.backward_codes.value_or(s.as_codes);
    // A block-scaled weight's codes: also the part this call multiplies.
    return s.as_codes != codes || (codes && s.block && !fsdp::block_parts_ready(*this, s, forward));
  };
  if (u.state != Unit::State::kFree && std::any_of(u.spaces.begin(), u.spaces.end(), other_way)) {
    reshard(u);
  }
  if (u.state == Unit::State::kGathered) return;
  start_gather(u, forward);
  auto& pg = detail::ProcessGroupAccess::impl(group);
  if (u.gathered) fsdp::current_stream_waits(*u.gathered);
  u.gathered.reset();
  for (auto& s : u.spaces) {
    if (s.gather) pg.wait(s.gather, "all-gather (parameters)");
    s.gather.reset();
    s.send = at::Tensor();
    for (const int64_t i : s.params) {
      auto& p = params[i];
      // A weight gathered as codes is read through them: its own data is a stand-in.
      p.tensor.set_data(s.as_codes ? p.stand_in
                                   : s.gathered.narrow(0, p.offset, p.numel).view(p.shape));
    }
    if (s.as_codes && s.block) {
      fsdp::finish_block_gather(*this, s, forward);
    } else if (s.as_codes && forward) {
      fsdp::give_codes(*this, s);
    }
    // A forward no backward follows (an evaluation) that no forward of a
    // backward to come gathered before keeps no casts: the masters may
    // change before the next (an evaluation between a backward and the
    // optimizer's step). Every rank decides alike.
    if (forward && !at::GradMode::is_enabled() && !s.backward_codes) s.forget_casts();
  }
  u.state = Unit::State::kGathered;
}

void FullyShardedDataParallel::Impl::reshard(Unit& u) {
  if (u.state == Unit::State::kFree) return;
  auto& pg = detail::ProcessGroupAccess::impl(group);
  // Side streams: the memory goes back to the gather stream's pool, reused
  // after that stream has waited for the compute stream's reads of it.
  u.gathered.reset();
  for (auto& s : u.spaces) {
    if (s.gather) pg.wait(s.gather, "all-gather (parameters)");  // never free memory in flight
    s.gather.reset();
    s.send = at::Tensor();
    for (const int64_t i : s.params) params[i].tensor.set_data(params[i].placeholder);
    if (s.fp8) fsdp::drop_codes(*this, s);
    if (s.block && s.as_codes) {
      fsdp::release_block_codes(*this, s);
      continue;
    }
    at::Tensor& target = gather_target(s);
    fsdp::release_storage(target);
    gathered_bytes -= size_in_bytes(target);
  }
  u.state = Unit::State::kFree;
}

void FullyShardedDataParallel::Impl::start_pass() {
  order.clear();
  // Inside a backward (a forward it calls) nothing of it may go; nothing
  // held (after a backward, or forwards that kept nothing), nothing to do.
  bool holds = false;
  for (const auto& u : units) {
    holds = holds || u.state != Unit::State::kFree ||
            std::any_of(u.spaces.begin(), u.spaces.end(),
                        [](const Space& s) { return s.holds_casts(); });
  }
  if (!end_queued && holds) {
    // What forwards without backward since left (ZeRO-2's gathered units,
    // a prefetched unit no forward called, FP8 casts) serves only the
    // backward of a graph still alive; with none, it goes. With one, it
    // goes where the optimizer has stepped the masters since: their
    // version counters (the pieces are views of them), agreed over the
    // ranks (a rank whose pieces are all padding steps none). Every rank
    // decides alike: the same calls keep the same outputs.
    pending_graphs.erase(std::remove_if(pending_graphs.begin(), pending_graphs.end(),
                                        [](const auto& g) { return g.expired(); }),
                         pending_graphs.end());
    bool stale = pending_graphs.empty();
    if (!stale) {
      float stepped = 0.0f;
      at::TensorOptions on = at::kFloat;
      for (const auto& u : units) {
        for (const auto& s : u.spaces) {
          if (s.master._version() != s.master_version) stepped = 1.0f;
          on = s.master.options();
        }
      }
      auto any = at::full({1}, stepped, on);
      group.all_reduce_max(any);
      stale = any.item<float>() > 0.0f;
    }
    if (stale) {
      for (auto& u : units) {
        reshard(u);
        for (auto& s : u.spaces) {
          s.backward_codes.reset();  // those forwards have no backward to come
          s.forget_casts();
        }
      }
      pending_graphs.clear();
    }
  }
  for (auto& u : units) {
    for (auto& s : u.spaces) s.master_version = static_cast<int64_t>(s.master._version());
  }
}

void FullyShardedDataParallel::Impl::pre_forward(Unit& u) {
  const int64_t index = u.index;
  // A pass starts with the outermost call of the first unit called.
  if (depth == 0 && (order.empty() || order.front() == index)) start_pass();
  ++depth;
  order.push_back(index);
  finish_gather(u, /*forward=*/true);
  const size_t k = order.size() - 1;
  if (options.prefetch() && k + 1 < recorded_order.size() && recorded_order[k] == index) {
    start_gather(units[recorded_order[k + 1]], /*forward=*/true);
  }
}

void FullyShardedDataParallel::Impl::post_forward(Unit& u, const std::vector<at::Tensor>& outputs) {
  --depth;
  bool hooked = false;
  if (at::GradMode::is_enabled()) {
    for (const auto& out : outputs) {
      if (!out.defined() || !out.requires_grad()) continue;
      auto link = link_;
      const int64_t index = u.index;
      const_cast<at::Tensor&>(out).register_hook([link, index](const at::Tensor&) {
        if (*link != nullptr) (*link)->pre_backward((*link)->units[index]);
      });
      if (out.grad_fn()) pending_graphs.emplace_back(out.grad_fn());
      hooked = true;
    }
  }
  if (!hooked || options.reshard_after_forward()) reshard(u);
}

void FullyShardedDataParallel::Impl::pre_backward(Unit& u) {
  queue_end_of_backward();
  finish_gather(u, /*forward=*/false);
  if (!options.prefetch()) return;
  // The unit whose backward comes next: the one called before this one
  // (for the first called, the last).
  const auto at = std::find(order.rbegin(), order.rend(), u.index);
  if (at == order.rend()) return;
  const auto position = static_cast<size_t>(std::distance(at, order.rend())) - 1;
  const int64_t next = position == 0 ? order.back() : order[position - 1];
  if (next != u.index && units[next].grads_expected > 0 && !units[next].reduced) {
    start_gather(units[next], /*forward=*/false);
  }
}

void FullyShardedDataParallel::Impl::queue_end_of_backward() {
  if (end_queued) return;
  end_queued = true;
  auto link = link_;
  torch::autograd::Engine::get_default_engine().queue_callback([link] {
    if (*link != nullptr) (*link)->end_of_backward();
  });
}

void FullyShardedDataParallel::Impl::on_grad(int64_t i) {
  queue_end_of_backward();
  torch::NoGradGuard no_grad;
  auto& p = params[i];
  auto& u = units[p.unit];
  auto& s = u.spaces[p.space];
  const auto grad = p.tensor.grad();
  if (!grad.defined()) return;
  if (!s.reduce_in.defined()) {
    s.reduce_in = at::zeros({s.gathered.numel()}, s.master.options().dtype(options.reduce_dtype()));
  }
  s.reduce_in.narrow(0, p.offset, p.numel).copy_(grad.reshape({-1}));
  p.tensor.mutable_grad() = at::Tensor();  // its bytes are free again
  ++s.grads_seen;
  if (s.grads_seen == s.grads_expected) launch_reduce(u, s);
}

void FullyShardedDataParallel::Impl::launch_reduce(Unit& u, Space& s) {
  // One reduction at a time ahead of the compute stream, whose full-size
  // buffer is then free, as FSDP2 waits for the previous reduce-scatter
  // (a wait of the GPU's, not the host's).
  if (streams && streams->reduced) fsdp::current_stream_waits(*streams->reduced);
  {
    const fsdp::OnSideStream side(streams ? &streams->reduce : nullptr);
    const double pre = divide_factors(group.world_size(), options.reduce_dtype()).first;
    if (pre != 1.0) s.reduce_in.div_(pre);
    s.reduce_out = at::empty({s.master.numel()}, s.reduce_in.options());
    s.reduce =
        detail::ProcessGroupAccess::impl(group).reduce_scatter_async(s.reduce_out, s.reduce_in);
    bytes_communicated += s.reduce_in.numel() * static_cast<int64_t>(s.reduce_in.element_size());
    s.reduced = true;
    if (streams) {
      // The reduce stream takes the mean into the pieces' .grad in turn,
      // the host and the compute stream going on; end_of_backward() makes
      // the compute stream wait for the last.
      finish_reduce(s);
      streams->reduced = fsdp::record_event(streams->reduce.device());
    } else {
      // One reduction in flight while backward goes on: the ones before
      // this are finished now, so that their full-size buffers are not all
      // held at the end of backward (4 bytes a parameter in fp32), as FSDP2
      // waits on the previous reduce-scatter.
      if (in_flight) finish_reduce(units[in_flight->first].spaces[in_flight->second]);
      in_flight.emplace(u.index, &s - u.spaces.data());
    }
  }
  if (std::all_of(u.spaces.begin(), u.spaces.end(),
                  [](const Space& x) { return x.reduced || x.grads_expected == 0; })) {
    u.reduced = true;
    reshard(u);  // its backward is over
  }
}

void FullyShardedDataParallel::Impl::finish_reduce(Space& s) {
  torch::NoGradGuard no_grad;
  const double post = divide_factors(group.world_size(), options.reduce_dtype()).second;
  auto& pg = detail::ProcessGroupAccess::impl(group);
  if (streams) {
    TORCH_INTERNAL_ASSERT(!s.reduce.via_all_reduce, "NCCL has a reduce-scatter");
    pg.stream_wait(s.reduce.work, "reduce-scatter");
    // Made on the compute stream: not reused there before the reduce
    // stream is past its reads.
    s.reduce_in.record_stream(streams->reduce);
  } else {
    pg.wait(s.reduce);
  }
  s.reduce_in = at::Tensor();  // the unit's full-size buffer: free as soon as the sum is in
  auto mean = s.reduce_out.scalar_type() == at::kFloat ? s.reduce_out : s.reduce_out.to(at::kFloat);
  s.reduce_out = at::Tensor();
  mean.mul_(1.0 / post);
  for (const int64_t i : s.params) {
    auto& piece = params[i].piece;
    if (!piece.defined() || piece.numel() == 0) continue;
    auto part = mean.narrow(0, params[i].piece_offset, piece.numel());
    if (piece.grad().defined()) {
      piece.mutable_grad().add_(part);
    } else {
      piece.mutable_grad() = part.clone();  // its own: optimizers detach_() gradients
    }
  }
  s.reduce = {};
  s.grads_seen = 0;
}

void FullyShardedDataParallel::Impl::end_of_backward() {
  torch::NoGradGuard no_grad;
  // Parameters that got no gradient count as zero in a space that got some.
  for (auto& u : units) {
    for (auto& s : u.spaces) {
      if (!s.reduced && s.grads_seen > 0) launch_reduce(u, s);
    }
  }
  if (in_flight) finish_reduce(units[in_flight->first].spaces[in_flight->second]);
  in_flight.reset();
  if (streams && streams->reduced) fsdp::current_stream_waits(*streams->reduced);
  if (streams) streams->reduced.reset();
  for (auto& u : units) {
    reshard(u);
    u.reduced = false;
    for (auto& s : u.spaces) {
      s.reduced = false;
      s.backward_codes.reset();  // the next forwards gather as their region says
      s.forget_casts();          // and cast with the scales the stepped masters give
    }
  }
  if (recorded_order.empty()) recorded_order = order;
  end_queued = false;
  pending_graphs.clear();
}

void fsdp::register_units(std::vector<Unit>& units) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  for (auto& u : units) {
    TORCH_CHECK(g_registry.count(u.module) == 0, "FullyShardedDataParallel: unit '", u.name,
                "' is already sharded by another FullyShardedDataParallel");
  }
  for (auto& u : units) g_registry[u.module] = &u;
}

void fsdp::unregister_units(const std::vector<Unit>& units) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  for (const auto& u : units) {
    const auto it = g_registry.find(u.module);
    if (it != g_registry.end() && it->second == &u) g_registry.erase(it);
  }
}

#endif  // AMPX_WITH_DIST

}  // namespace dist

namespace detail {

UnitCall::UnitCall(const torch::nn::Module* module) {
  auto* unit = dist::unit_of(module);
  if (unit == nullptr) return;
#if defined(AMPX_WITH_DIST)
  unit->impl->pre_forward(*unit);
  unit_ = unit;
#endif
}

UnitCall::~UnitCall() {
#if defined(AMPX_WITH_DIST)
  // A forward that threw: the unit stays gathered until the next reshard.
  if (unit_ != nullptr && !finished_) --static_cast<dist::fsdp::Unit*>(unit_)->impl->depth;
#endif
}

void UnitCall::finish(const std::vector<at::Tensor>& outputs) {
  finished_ = true;
#if defined(AMPX_WITH_DIST)
  if (unit_ == nullptr) return;
  auto* unit = static_cast<dist::fsdp::Unit*>(unit_);
  unit->impl->post_forward(*unit, outputs);
#else
  (void)outputs;
#endif
}

}  // namespace detail
}  // namespace ampx
