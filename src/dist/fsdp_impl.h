#pragma once

// FullyShardedDataParallel's insides, shared by its sources: fsdp.cpp (the
// gathers, hooks and reduce-scatters of a step) and fsdp_setup.cpp
// (construction, sharding, clipping, the full state).

#include "ampx/fp8/block.h"
#include "ampx/fp8/cast.h"
#include "ampx/fp8/scaling.h"
#include "ampx/fsdp.h"

#include <ATen/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
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

/// A weak reference to an autograd node: std::weak_ptr while LibTorch's
/// grad_fn() is a std::shared_ptr (1.13), c10::weak_intrusive_ptr since it is
/// an intrusive_ptr (2.14 and later).
template <typename Strong>
struct WeakOf;
template <typename T>
struct WeakOf<std::shared_ptr<T>> {
  using type = std::weak_ptr<T>;
};
template <typename T, typename N>
struct WeakOf<c10::intrusive_ptr<T, N>> {
  using type = c10::weak_intrusive_ptr<T, N>;
};
using WeakGraph =
    typename WeakOf<std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())>>::type;

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
  torch::nn::Module* fp8_layer = nullptr;  // fp8_all_gather: the FP8 layer it is the weight of
  at::Tensor stand_in;  // such a weight's data while gathered as codes (fp8::weight_stand_in)
};

/// How a weight of an FP8 space is cast in this backward's gathers (Space::casts).
struct Fp8Cast {
  at::Tensor scale, scale_inv, amax;  // float32 [1]; amax: the whole weight's
  fp8::Fp8Format format = fp8::Fp8Format::kE4M3;
};

/// fp8_all_gather of a block-scaled layer's weight, alone in its space: the
/// weight's rows are sharded, each rank's a multiple of every block's rows,
/// so that each rank quantizes whole blocks of its rows, the codes and
/// scales the whole weight's quantization has there; the ranks gather them
/// (FP4 codes two to a byte) into the whole weight's tensors.
struct BlockGather {
  enum Part { kForward = 0, kBackward = 1 };  // the forward product's, the input gradient's
  fp8::BlockWeightFormats formats;            // the layer's recipe's at construction
  int64_t rows = 0, cols = 0;                 // the weight's
  int64_t shard_rows = 0;                     // each rank's, padding included
  // Per part, the whole weight's codes [world * shard_rows, cols] and
  // scales (padding rows included), their storage freed between uses, and
  // the views of its real rows the layer is given (and saves for backward,
  // the gather before which fills their storage again).
  fp8::BlockTensor whole[2], given[2];
  bool held[2] = {false, false};  // parts with storage: gathered, or on their way
  std::vector<Part> moving;       // the parts of the gathers in flight
  at::Tensor packed[2];           // FP4 codes two to a byte, where they land, until unpacked
  // The gathers in flight (each part's codes and scales, straight into the
  // whole tensors), and what they send (made before they start).
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> sends;
  // NVFP4: the whole weight's amax (NaN if any element is), all-reduced at
  // the first gather after a backward (or a load) and kept until the next.
  std::optional<float> global_amax;
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
  bool reduced = false;  // launched in this backward (in flight or finished)
  // fp8_all_gather: a space of FP8 layers' weights, gathered as codes for a
  // forward in an FP8 region (and for the backward after it), else in dtype.
  bool fp8 = false;
  bool as_codes = false;               // the gather in hand (or the last) is of codes
  std::optional<bool> backward_codes;  // how this backward's forwards gathered it
  int64_t master_version = 0;          // master's version counter at the last pass's start
  at::Tensor codes;                    // uint8, padded; its storage freed between uses
  // Per params[j], how its codes are cast: computed at the first gather of
  // codes after a backward (or a load), then kept, so that every gather of
  // one backward's forwards writes the same bytes.
  std::vector<Fp8Cast> casts;
  // A block-scaled layer's weight (fp8 is true): gathered as codes and
  // scales, else as above.
  std::shared_ptr<BlockGather> block;

  /// Whether it keeps casts (or a block space's whole amax) from a gather.
  bool holds_casts() const { return !casts.empty() || (block && block->global_amax); }
  /// Drops the casts (and a block space's whole amax): the next gather of
  /// codes takes them anew, from the masters as they are then.
  void forget_casts() {
    casts.clear();
    if (block) block->global_amax.reset();
  }
};

/// CUDA masters over NCCL: the streams the gathers and the gradients'
/// reductions run on beside the compute's (FSDP2's all-gather and
/// reduce-scatter streams), so that the casts, copies and arithmetic around
/// the collectives do not queue with the compute, and the host waits for
/// no collective: each side stream waits for the compute stream before its
/// work (the masters stepped, the gradients made, the memory it reuses
/// read), and an event makes the compute stream wait where it reads the
/// result (a unit's gather before its forward or backward, every reduction
/// at the end of backward).
struct SideStreams {
  c10::Stream gather, reduce;
  std::shared_ptr<c10::Event> reduced;  // after the last reduction launched
  /// Two streams of `device`'s pool.
  static SideStreams on(c10::Device device);
};

/// Within its scope the current stream is `side` (where given), which first
/// waits for the stream current before it.
class OnSideStream {
 public:
  explicit OnSideStream(const c10::Stream* side);

 private:
  std::optional<c10::StreamGuard> guard_;
};

/// An event recorded on the current stream of `device`.
std::shared_ptr<c10::Event> record_event(c10::Device device);
/// Makes the current stream of `event`'s device wait for it.
void current_stream_waits(const c10::Event& event);

struct Unit {
  Impl* impl = nullptr;
  const torch::nn::Module* module = nullptr;
  std::string name;  // "" for the root
  int64_t index = 0;
  std::vector<Space> spaces;
  enum class State { kFree, kGathering, kGathered } state = State::kFree;
  std::shared_ptr<c10::Event> gathered;  // SideStreams: after its gathers, until waited for
  int64_t grads_expected = 0;
  bool reduced = false;  // its gradients are on their way in this backward
};

/// `t`'s numel times its element size, whether its storage holds them or not.
inline int64_t size_in_bytes(const at::Tensor& t) {
  return static_cast<int64_t>(t.nbytes());
}

/// Gives `t`'s storage room for its elements (again): a gather writes there.
void allocate_storage(const at::Tensor& t);
/// Frees `t`'s storage; tensors saved for backward keep the storage object,
/// which the gather before backward fills again.
void release_storage(const at::Tensor& t);

/// fp8_all_gather: the FP8 layer (ampx::fp8::Linear or a converted
/// torch::nn::Linear) whose weight `t` is, `owner` holding it; else null.
torch::nn::Module* fp8_layer_of(torch::nn::Module& owner, const at::Tensor& t);
/// Whether a forward gather of the FP8 space `s` moves codes: an FP8 region
/// is on and each of its layers is still FP8 under a tensorwise recipe.
bool codes_wanted(const Impl& impl, const Space& s);
/// How a gather of `s` (of unit `u`) moves it: for a forward, as
/// codes_wanted() says, noted for the backward where gradients are
/// recorded (a backward whose forwards gathered it both ways is refused);
/// for a backward, as its forwards did.
bool gather_as_codes(const Impl& impl, const Unit& u, Space& s, bool forward);
/// This rank's shard of `s` as its layers' codes, padded, cast as s.casts
/// says: where it is empty, first the scales of the whole weights (one
/// all-reduce (max) of the shards' amaxes).
at::Tensor cast_shard(Impl& impl, Space& s);
/// Gives each layer of `s` its gathered codes (TensorScaling::give_weight).
void give_codes(Impl& impl, Space& s);
/// Takes them back.
void drop_codes(Impl& impl, Space& s);

/// Whether the FP8 layer `layer` is under a block-scaled recipe.
bool is_block_scaled(torch::nn::Module& layer);
/// fp8_all_gather: how `weight`, of the FP8 layer `layer`, is gathered as
/// codes over `world` ranks where the layer is block-scaled; else null
/// (also where whole blocks on every rank would be mostly padding).
std::shared_ptr<BlockGather> block_gather_of(torch::nn::Module& layer, const at::Tensor& weight,
                                             int64_t world);
/// Whether a block space's gathered parts serve a gather for `forward`
/// (else for a backward).
bool block_parts_ready(const Impl& impl, const Space& s, bool forward);
/// NVFP4: the whole amaxes of unit `u`'s block spaces gathered as codes
/// that have none since the last backward (or load): one all-reduce (max)
/// of their shards' [amax, any NaN], one read of it.
void whole_amaxes(Impl& impl, Unit& u);
/// This rank's rows of a block space quantized in the parts a forward (or
/// backward) needs, ready to send (FP4 codes two to a byte).
void quantize_block_shard(Impl& impl, Space& s, bool forward);
/// Starts the gathers of what quantize_block_shard() made, each part's
/// codes and scales into the whole weight's (their storage made).
void start_block_gather(Impl& impl, Space& s);
/// Waits for them, unpacks FP4 codes, and for a forward gives the layer
/// its weight (LinearScaling::give_block_weight).
void finish_block_gather(Impl& impl, Space& s, bool forward);
/// Frees a block space's parts (after any gather in flight).
void release_block_codes(Impl& impl, Space& s);

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

  std::vector<int64_t> order;           // units called in this pass, in call order
  std::vector<int64_t> recorded_order;  // the first step's, for prefetching
  int depth = 0;                        // sharded_forward calls in progress
  bool end_queued = false;              // end_of_backward queued in this backward
  /// The graphs of the forwards since the last backward (their hooked
  /// outputs' grad_fn): while one is alive, a backward may still come.
  std::vector<fsdp::WeakGraph> pending_graphs;
  std::optional<std::pair<int64_t, int64_t>> in_flight;  // (unit, space) of the reduction in flight

  int64_t gathered_bytes = 0, peak_gathered_bytes = 0, bytes_communicated = 0;
  std::optional<fsdp::SideStreams> streams;  // CUDA masters over NCCL

  Impl(std::shared_ptr<torch::nn::Module> m, ProcessGroup g, FullyShardedDataParallelOptions o)
      : model(std::move(m)), group(std::move(g)), options(std::move(o)) {}

  /// `forward`: a gather for a forward (its FP8 spaces as an FP8 region
  /// says), else for a backward (as that backward's forwards gathered them).
  void start_gather(fsdp::Unit& u, bool forward);
  void finish_gather(fsdp::Unit& u, bool forward);
  void reshard(fsdp::Unit& u);
  /// A pass (the outermost call of the unit called first) starts: what
  /// forwards since the last backward left gathered (ZeRO-2's units, a
  /// prefetch no forward took) or cast (FP8 casts kept for a backward)
  /// goes where no graph that backward could run on is alive, or where the
  /// optimizer has stepped the masters (any rank's) since.
  void start_pass();
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
