#pragma once

/// \file
/// Fully sharded data parallelism (ZeRO-3, and ZeRO-2 as a setting) on
/// ampx::dist's c10d process groups: each rank keeps only its 1/world_size
/// share of every parameter, as fp32 masters, and so of the gradients and
/// the optimizer state; a unit of the model (a transformer block, the
/// embedding, the head) is gathered in the compute dtype only while it
/// computes. PyTorch's FSDP2 (`fully_shard` with a `MixedPrecisionPolicy`)
/// is the design; this is it for LibTorch's C++ modules.
///
/// ```
///   auto pg = ampx::dist::init_process_group();
///   auto model = GPT(config);                          // the same on every rank
///   ampx::dist::FullyShardedDataParallel fsdp(
///       model.ptr(), pg, {model->blocks[0].ptr(), model->blocks[1].ptr(), model->head.ptr()},
///       ampx::dist::FullyShardedDataParallelOptions().param_dtype(torch::kBFloat16));
///   ampx::optim::AdamW opt(fsdp.parameters(), ampx::optim::AdamWOptions(3e-4));  // fp32 shards
///   ampx::GradScaler scaler;
///   ampx::dist::synchronize_found_inf(scaler, pg);     // every rank skips together
///   for (...) {
///     opt.zero_grad();
///     auto loss = loss_fn(ampx::dist::sharded_forward(model, x), y);
///     scaler.scale(loss).backward();                   // gradients arrive reduce-scattered
///     scaler.unscale_(opt);
///     fsdp.clip_grad_norm_(1.0);                       // the norm over every rank's shards
///     scaler.step(opt);
///     scaler.update();
///   }
///   // inside GPT's forward, each unit goes through sharded_forward too:
///   //   for (auto& block : blocks) x = ampx::dist::sharded_forward(block, x);
///
///   // Checkpoints: each rank writes its own shard; any number of ranks
///   // reads them back (every rank reads every file: a shared folder).
///   torch::serialize::OutputArchive out;
///   fsdp.save_shard(out, &opt);
///   ampx::save_archive(out, "shard-" + std::to_string(pg.rank()) + ".pt");
///   fsdp.load_shards(saved_world_size, [](int64_t r, torch::serialize::InputArchive& in) {
///     ampx::load_archive(in, "shard-" + std::to_string(r) + ".pt");
///   }, &opt);
/// ```
///
/// A unit's parameters are laid end to end in one flat space per parameter
/// dtype (the compute dtype, and fp32 for norm layers kept in fp32), padded
/// to a multiple of the world size and cut into equal shards: rank r's
/// master shard holds elements [r S, (r+1) S) of it (fp32). parameters()
/// are this rank's piece of each parameter, views of that shard; a piece may
/// be empty. Between its calls a unit's parameters in the module are empty
/// tensors (shape {0}): read the model's weights through full_state_dict().
///
/// Per unit and dtype, each step: one all-gather before its forward (the
/// master shard cast to the compute dtype once, before the collective; the
/// next unit's gather is issued before this one computes), freed after it
/// (reshard_after_forward) or kept until its backward; gathered again
/// before its backward if freed (the unit before it prefetched); its
/// gradients copied into one flat buffer in the reduce dtype as each is
/// accumulated and reduce-scattered (summed) in one collective as soon as
/// the last arrives; the mean is taken after it (fp32 and bfloat16) or
/// split around it (float16: divided by a power of two near sqrt(world)
/// before, the rest after, as FSDP does, so the sum neither overflows nor
/// underflows). At the end of backward the shards' gradients are in fp32 in
/// parameters()'s .grad (added to what is there). What forwards without a
/// backward since leave (ZeRO-2's gathered units, a prefetched unit no
/// forward called, FP8 casts) is dropped when the next pass starts if no
/// graph of theirs is alive (an evaluation whose outputs are gone), or if
/// the optimizer has stepped any rank's shards since (their version
/// counters, agreed in one all-reduce: an optimizer that writes through
/// .data(), as LibTorch's SGD does, moves none), so that a forward never
/// computes with weights or FP8 scales from before a step.
///
/// CUDA parameters over NCCL: the gathers (with their casts) run on a side
/// stream and the reductions (with the division and the mean into .grad)
/// on another, each waiting for the compute stream first; the compute
/// stream waits for a unit's gather before computing with it and for the
/// last reduction at the end of backward, the host for neither.
///
/// FP8 all-gather (fp8_all_gather): the weights of a unit's FP8 layers
/// form a flat space of their own. Gathered for a forward in an FP8 region,
/// each rank casts its fp32 shard of each weight to the layer's E4M3 codes
/// (one all-reduce (max) of the shards' amaxes first, so that every rank
/// casts with the scale of the whole weight: delayed scaling's from its
/// history, current scaling's from that amax) and the ranks gather the
/// codes: 1 byte an element where bfloat16 moves 2 and float32 4. The layer
/// computes with the gathered codes (TensorScaling::give_weight) and records
/// the whole weight's amax, as it would casting the gathered weight: with
/// param_dtype float32 the codes, the amaxes and so the training are those
/// of a gather in float32, bit for bit (on the CPU, where it is tested).
/// With a 16-bit param_dtype they are closer to the masters (one rounding,
/// not two). The scales are taken at a unit's first gather of codes after a
/// backward (or load_shards(), or a step after forwards without backward)
/// and kept until the next backward ends, so
/// that every gather of one backward's forwards, and the gather again for
/// the backward, writes the same codes. A unit gathered (prefetched) in one
/// way and called in the other is gathered again; one backward's forwards
/// of a unit must run all inside or all outside the FP8 region (a forward
/// without backward, under torch::NoGradGuard, may differ), and FP8 must
/// stay on, or off, for the whole of a unit's forward: the gathered weight
/// is a stand-in (fp8::weight_stand_in) that ampx::fp8::Linear refuses
/// outside a region and that computes NaN in a converted Linear there.
///
/// A block-scaled FP8 layer's weight (MXFP8, NVFP4, FP8 blockwise:
/// ampx/fp8/block_recipe.h) is a space of its own, its rows cut into equal
/// shards of whole blocks (a multiple of 32 rows for MXFP8, 16 for NVFP4,
/// the block for FP8 blockwise; padding after the last rows, on one rank
/// or several). Gathered in an FP8 region, each rank quantizes its fp32
/// rows as the layer quantizes its weight (NVFP4 with the whole weight's
/// amax: one all-reduce (max) per unit at its first gather after a
/// backward or load_shards()) and the ranks gather the codes (FP4 two to a
/// byte) and the blocks' scales, as TE's FSDP2 gathers its MXFP8 weights:
/// for a forward the copy its product takes (blocks along the rows), for a
/// backward the copy the input gradient takes (blocks down the columns),
/// both for a forward whose unit is kept to its backward
/// (reshard_after_forward false); 2-D weight blocks (NVFP4's 16 x 16, FP8
/// blockwise, MXFP8's weight_2d) one copy for both.
/// Each block depends on its own elements alone, so the layer computes with
/// the codes and scales its own quantization of the fp32 weight has: with
/// param_dtype float32 the training is that of a gather in float32, bit
/// for bit (on the CPU). Two all-gathers (codes, scales) per copy of each
/// such weight, not one per unit; outside an FP8 region the weight is
/// gathered in param_dtype in its own space. A weight whose whole blocks on
/// every rank would be more than twice its rows (small weights, many ranks,
/// FP8 blockwise's 128-row blocks) stays in its unit's space, gathered in
/// param_dtype.
///
/// Every rank must call the units in the same order (no data-dependent
/// control flow), and a parameter belongs to one unit (no weights tied
/// across units). What is not in a listed unit belongs to the root, `model`.
/// An optimizer whose update reads a whole parameter's norms (LAMB's trust
/// ratio, ampx::optim::LAMB) gets them through piece_sums(), below.
/// Activation checkpointing (a unit's forward run again in backward,
/// ampx::checkpoint) is not either. Run the forward under ampx::AutocastGuard, or under the
/// forward_guard() of ampx::initialize(fsdp, ...)'s session (below): the
/// units compute in param_dtype, their inputs are not cast.

#include "ampx/amp.h"
#include "ampx/dist.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/any.h>
#include <torch/ordered_dict.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
namespace optim {
class Optimizer;
}  // namespace optim
namespace serialize {
class InputArchive;
class OutputArchive;
}  // namespace serialize
}  // namespace torch

namespace ampx {
namespace detail {
class UnitCall;
}  // namespace detail

namespace dist {

/// FullyShardedDataParallel's settings (FSDP2's MixedPrecisionPolicy and
/// reshard_after_forward), set by chained calls.
struct FullyShardedDataParallelOptions {
  /// The dtype units are gathered and compute in: float32 (no mixed
  /// precision), bfloat16 or float16. The masters stay fp32.
  TORCH_ARG(c10::ScalarType, param_dtype) = c10::kFloat;
  /// The dtype gradients are summed in across ranks: float32 (the
  /// default, as FSDP users set it), bfloat16 or float16.
  TORCH_ARG(c10::ScalarType, reduce_dtype) = c10::kFloat;
  /// Free a unit's gathered parameters after its forward and gather them
  /// again for its backward (ZeRO-3); false keeps them until the end of
  /// backward (ZeRO-2: one all-gather a step, more memory).
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// Issue the next unit's all-gather before this one computes (forward:
  /// the call order seen in the first step; backward: the reverse).
  TORCH_ARG(bool, prefetch) = true;
  /// Keep the parameters of norm layers (LayerNorm, BatchNorm, GroupNorm,
  /// InstanceNorm) in fp32 when param_dtype is 16-bit, as O2 does: they are
  /// gathered in fp32, in their own collective.
  TORCH_ARG(bool, keep_norms_fp32) = true;
  /// Broadcast rank 0's parameters and buffers at construction.
  TORCH_ARG(bool, broadcast_parameters) = true;
  /// Gather the weights of FP8 layers (ampx::fp8::Linear, and Linears
  /// ampx::fp8::convert_linears converted before this wrapper was made):
  /// under delayed or current scaling as their E4M3 codes, one byte an
  /// element, when their unit is gathered for a forward in an
  /// Fp8AutocastGuard region (torchao's enable_fsdp_float8_all_gather; see
  /// "FP8 all-gather" above); block-scaled layers' as their codes and
  /// scales. Outside a region they are gathered in param_dtype.
  TORCH_ARG(bool, fp8_all_gather) = false;
};

/// Shards `model` over `group` (see the top of this header). Construction is
/// collective: the ranks compare their models' parameters and the options,
/// broadcast rank 0's weights, and each keeps its shards.
class FullyShardedDataParallel {
 public:
  /// `units`: submodules of `model` (or `model` itself), each gathered as
  /// one; parameters of a unit nested in another belong to the inner one;
  /// the rest of `model`'s parameters form the root unit.
  FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> model, ProcessGroup group,
                           std::vector<std::shared_ptr<torch::nn::Module>> units,
                           FullyShardedDataParallelOptions options = {});
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  /// This rank's fp32 pieces of the parameters that require grad, in
  /// module order, empty pieces left out: what the optimizer steps.
  std::vector<at::Tensor> parameters() const;
  /// The same with the parameters' names in the model.
  torch::OrderedDict<std::string, at::Tensor> named_parameters() const;

  /// Scales the gradients of parameters() so that the L2 norm over every
  /// rank's pieces is at most `max_norm` (torch::nn::utils::clip_grad_norm_'s
  /// coefficient max / (norm + 1e-6), at most 1), one scalar all-reduce.
  /// Returns the norm before clipping, the same on every rank.
  double clip_grad_norm_(double max_norm);

  /// Sums over the pieces of parameters() added across ranks, for an
  /// ampx::optim optimizer whose update reads whole parameters' norms
  /// (LAMB's trust ratio): `opt.set_piece_sums(fsdp.piece_sums())`. Given
  /// pieces and an [n, k] float64 tensor of sums over each, it returns the
  /// sums over every rank's pieces of the same parameters (one all-reduce
  /// of k numbers per parameter). Collective; valid while this wrapper lives.
  std::function<at::Tensor(const std::vector<at::Tensor>& pieces, const at::Tensor& sums)>
  piece_sums() const;

  /// Every parameter and buffer at full size in fp32 (buffers in their
  /// dtype) on rank 0, gathered one unit at a time; empty on the others.
  /// Collective.
  torch::OrderedDict<std::string, at::Tensor> full_state_dict();

  /// Calls `visit(name, value)` on rank 0 for every parameter at full size
  /// in fp32, gathered one unit at a time (the units as listed, the root
  /// last): `value` lives only during the call, and rank 0 holds one unit's
  /// parameters at a time, never the whole model. The other ranks take part
  /// in the gathers and call nothing. If `visit` throws, the gathers go on
  /// without it and every rank throws rank 0's error. Collective.
  void for_each_full_parameter(
      const std::function<void(const std::string& name, const at::Tensor& value)>& visit);

  /// Writes every parameter at full size in `dtype` (float32: the masters;
  /// bfloat16 or float16: rounded to nearest) and every buffer to the
  /// safetensors file `path` on rank 0, gathered and written one unit at a
  /// time (for_each_full_parameter()): ampx::save_safetensors() of
  /// full_state_dict(), its parameters in `dtype`, byte for byte, without
  /// rank 0 ever holding the whole model. `metadata` is the header's
  /// "__metadata__". Atomic, as save_safetensors() is: a temp file beside
  /// `path`, renamed over it once every tensor is in. An error on rank 0 (a
  /// missing folder, a full disk) throws on every rank, naming it, and
  /// leaves `path` as it was. Python: safetensors.torch.load_file(path).
  /// Collective.
  void save_full_safetensors(const std::string& path,
                             const std::map<std::string, std::string>& metadata = {},
                             c10::ScalarType dtype = c10::kFloat);

  /// Writes this rank's shard into `archive`: its fp32 piece of each
  /// parameter with the element of the parameter where the piece starts,
  /// the buffers, and, given `optimizer` (one of ampx::optim's, over
  /// parameters()), its moments and step counts for those pieces. Each rank
  /// saves its own (e.g. ampx::save_archive to a file of its own).
  void save_shard(torch::serialize::OutputArchive& archive,
                  const torch::optim::Optimizer* optimizer = nullptr) const;
  /// Reads saved rank `rank`'s shard into `archive` (e.g. ampx::load_archive
  /// of its file); throws naming what it could not read.
  using ShardReader = std::function<void(int64_t rank, torch::serialize::InputArchive& archive)>;
  /// Restores what `saved_world_size` ranks' save_shard() wrote, whatever
  /// this group's size (resharding): each rank reads every saved shard, one
  /// at a time, keeps the elements of its own pieces and checks that every
  /// element came from exactly one shard of the same parameter. `optimizer`
  /// (the same kind and param groups as the saved one, over parameters())
  /// gets the pieces' moments and step counts. Coded moments (bf16, FP8,
  /// 8-bit state_format) resume bit for bit on the ranks and pieces that
  /// saved them; on others they are encoded again in this rank's blocks
  /// (each block's scale from its new elements). A state_format other than
  /// the saved one is refused, naming both. Everything is read and
  /// checked before anything changes: an error on any rank throws on every
  /// rank, naming the rank and its error, and changes nothing. Collective.
  void load_shards(int64_t saved_world_size, const ShardReader& read_shard,
                   torch::optim::Optimizer* optimizer = nullptr);

  /// Bytes this rank holds between steps: fp32 master shards and their
  /// gradients (not the optimizer's state).
  int64_t sharded_bytes() const;
  /// The most bytes of gathered parameters held at once so far.
  int64_t peak_gathered_bytes() const;
  /// Bytes all-gathered and reduce-scattered so far by this rank.
  int64_t bytes_communicated() const;
  /// Units, root last: each unit's parameter names.
  std::vector<std::vector<std::string>> unit_layout() const;
  /// The model it shards.
  const std::shared_ptr<torch::nn::Module>& module() const;
  /// Its settings, as given at construction.
  const FullyShardedDataParallelOptions& options() const;

 public:
  struct Impl;  ///< ampx's own sources only (src/dist/fsdp_impl.h)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dist

/// Apex's opt levels on a sharded model: the wrapper's gathers are the
/// level's model cast, its shards the fp32 master weights. O0 and O1 need
/// param_dtype float32 (O1 casts under autocast), O2 param_dtype equal to
/// its dtype and keep_norms_fp32 equal to keep_batchnorm_fp32; O3, which
/// keeps no masters, is refused. The optimizers step parameters() (fp32:
/// they need no masters of their own). The session's forward_guard() and
/// cast_input() are the level's.
///
/// ```
///   ampx::dist::FullyShardedDataParallel fsdp(model, pg, units,
///       ampx::dist::FullyShardedDataParallelOptions().param_dtype(torch::kBFloat16));
///   ampx::optim::AdamW opt(fsdp.parameters(), ampx::optim::AdamWOptions(3e-4));
///   auto amp = ampx::initialize(fsdp, ampx::AmpOptions(ampx::OptLevel::O2));
///   ampx::dist::synchronize_found_inf(amp.scaler(), pg);
/// ```
AmpSession initialize(dist::FullyShardedDataParallel& model, const AmpOptions& options);

namespace detail {

/// What sharded_forward() does around a module's forward: gathers its unit
/// before (a module no FullyShardedDataParallel knows: nothing), hooks the
/// outputs for backward and frees the unit after.
class UnitCall {
 public:
  explicit UnitCall(const torch::nn::Module* module);
  ~UnitCall();
  UnitCall(const UnitCall&) = delete;
  UnitCall& operator=(const UnitCall&) = delete;
  /// After the forward: its tensor outputs.
  void finish(const std::vector<at::Tensor>& outputs);

 private:
  void* unit_ = nullptr;
  bool finished_ = false;
};

inline void collect(std::vector<at::Tensor>& out, const at::Tensor& t) {
  out.push_back(t);
}
inline void collect(std::vector<at::Tensor>& out, const std::vector<at::Tensor>& ts) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <typename... T>
void collect(std::vector<at::Tensor>& out, const std::tuple<T...>& t) {
  std::apply([&](const auto&... e) { (collect(out, e), ...); }, t);
}
template <typename T>
void collect(std::vector<at::Tensor>&, const T&) {}

template <typename M>
const torch::nn::Module* module_of(const M& m) {
  return m.get();  // std::shared_ptr<Impl> and torch::nn::ModuleHolder<Impl>
}
template <typename M>
const torch::nn::Module* module_of(M* m) {
  return m;
}

}  // namespace detail

namespace dist {

/// `module->forward(args...)`, with `module`'s unit gathered for it when a
/// FullyShardedDataParallel shards it (else just the call). Models call
/// their units (and the caller the model) through it.
template <typename M, typename... Args>
auto sharded_forward(M& module, Args&&... args) {
  ampx::detail::UnitCall call(ampx::detail::module_of(module));
  auto out = module->forward(std::forward<Args>(args)...);
  std::vector<at::Tensor> tensors;
  ampx::detail::collect(tensors, out);
  call.finish(tensors);
  return out;
}

/// The same for a torch::nn::AnyModule whose forward returns a tensor.
template <typename... Args>
at::Tensor sharded_forward(torch::nn::AnyModule& module, Args&&... args) {
  ampx::detail::UnitCall call(module.ptr().get());
  at::Tensor out = module.forward(std::forward<Args>(args)...);
  call.finish({out});
  return out;
}

}  // namespace dist
}  // namespace ampx
