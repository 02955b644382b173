#pragma once

// FullyShardedDataParallel's insides, shared by its sources: fsdp.cpp (the
// gathers, hooks and reduce-scatters of a step) and fsdp_setup.cpp
// (construction, sharding, clipping, the full state).

#include "ampx/fsdp.h"

#include <ATen/Tensor.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "process_group_impl.h"

namespace ampx {
namespace dist {

#if defined(AMPX_WITH_DIST)

namespace fsdp {

using Impl = FullyShardedDataParallel::Impl;
/// A gradient accumulator: std::shared_ptr before LibTorch 2.x's intrusive_ptr.
using Accumulator =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

/// One parameter of the model and where it lives.
struct Param {
  std::string name;
  at::Tensor tensor;  // the module's own: its data is a gathered view or the placeholder
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t unit = 0, space = 0;  // its unit, and the flat space in it (by dtype)
  int64_t offset = 0;           // in the space
  at::Tensor placeholder;       // {0} in the gather dtype, between calls
  at::Tensor piece;             // this rank's fp32 part, a view of the space's master shard
  int64_t piece_offset = 0;     // in the master shard
  Accumulator accumulator;      // kept: it carries the hook
};

/// The parameters of one unit gathered in one dtype, end to end.
struct Space {
  at::ScalarType dtype = at::kFloat;  // gathered and computed in
  std::vector<int64_t> params;        // indices into Impl::params
  int64_t numel = 0;                  // before padding to a multiple of the world size
  at::Tensor master;                  // fp32, this rank's shard: [world-size-th of the padded]
  at::Tensor gathered;                // dtype, padded; its storage freed between uses
  at::Tensor send;                    // the shard cast to dtype, while the gather is in flight
  c10::intrusive_ptr<c10d::Work> gather;
  int64_t grads_expected = 0;        // parameters that need a gradient
  int64_t grads_seen = 0;            // of them, accumulated in this backward
  at::Tensor reduce_in, reduce_out;  // the reduce dtype: padded, and this rank's shard
  ampx::detail::ProcessGroupAccess::Impl::ReduceScatter reduce;
  bool reduced = false;   // launched in this backward (in flight or finished)
};

struct Unit {
  Impl* impl = nullptr;
  const torch::nn::Module* module = nullptr;
  std::string name;  // "" for the root
  int64_t index = 0;
  std::vector<Space> spaces;
  enum class State { kFree, kGathering, kGathered } state = State::kFree;
  int64_t grads_expected = 0;
  bool reduced = false;  // its gradients are on their way in this backward
};

/// Gives `t`'s storage room for its elements (again): a gather writes there.
void allocate_storage(const at::Tensor& t);
/// Frees `t`'s storage; tensors saved for backward keep the storage object,
/// which the gather before backward fills again.
void release_storage(const at::Tensor& t);

/// Makes sharded_forward() find `units` (throws if another instance has one).
void register_units(std::vector<Unit>& units);
void unregister_units(const std::vector<Unit>& units);

}  // namespace fsdp

struct FullyShardedDataParallel::Impl {
  std::shared_ptr<torch::nn::Module> model;
  ProcessGroup group;
  FullyShardedDataParallelOptions options;
  std::vector<fsdp::Param> params;  // module order
  std::vector<fsdp::Unit> units;    // as listed, the root last
  /// Hooks reach this through the link; the destructor clears it.
  std::shared_ptr<Impl*> link_ = std::make_shared<Impl*>(this);

  std::vector<int64_t> order;                         // units called in this pass, in call order
  std::vector<int64_t> recorded_order;                // the first step's, for prefetching
  int depth = 0;                                      // sharded_forward calls in progress
  bool end_queued = false;                            // end_of_backward queued in this backward
  std::optional<std::pair<int64_t, int64_t>> in_flight;  // (unit, space) of the reduction in flight

  int64_t gathered_bytes = 0, peak_gathered_bytes = 0, bytes_communicated = 0;

  Impl(std::shared_ptr<torch::nn::Module> m, ProcessGroup g, FullyShardedDataParallelOptions o)
      : model(std::move(m)), group(std::move(g)), options(std::move(o)) {}

  void start_gather(fsdp::Unit& u);
  void finish_gather(fsdp::Unit& u);
  void reshard(fsdp::Unit& u);
  void pre_forward(fsdp::Unit& u);
  void post_forward(fsdp::Unit& u, const std::vector<at::Tensor>& outputs);
  void pre_backward(fsdp::Unit& u);
  void queue_end_of_backward();
  void on_grad(int64_t param);
  void launch_reduce(fsdp::Unit& u, fsdp::Space& s);
  /// Waits for `s`'s reduce-scatter and adds its mean to the pieces' .grad.
  void finish_reduce(fsdp::Space& s);
  void end_of_backward();
};

#else  // !AMPX_WITH_DIST

namespace fsdp {
struct Unit;
}  // namespace fsdp
struct FullyShardedDataParallel::Impl {};

#endif

}  // namespace dist
}  // namespace ampx
