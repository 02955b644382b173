#pragma once

/// \file
/// ZeRO stage 1 (Rajbhandari et al., 2020) on ampx::dist: every rank keeps
/// the fp32 master weights and optimizer state of only its 1/world_size
/// share of the parameters, so optimizer memory per rank falls by the world
/// size, and training gives the parameters of unsharded data parallelism.
///
/// ```
///   auto pg = ampx::dist::init_process_group();
///   ampx::dist::ZeroRedundancyOptimizer opt(model->parameters(), pg,   // model still fp32
///       [](std::vector<torch::Tensor> shard) {
///         return std::make_unique<ampx::optim::AdamW>(shard, ampx::optim::AdamWOptions(3e-4));
///       });
///   auto amp = ampx::initialize(model, {}, ampx::AmpOptions(ampx::OptLevel::O2));  // masters:
///   opt's ampx::dist::synchronize_found_inf(amp.scaler(), pg);   // all ranks skip together for
///   (...) {
///     opt.zero_grad();
///     amp.scaler().scale(loss_fn(model->forward(x_shard), y_shard)).backward();
///     amp.scaler().step(opt);   // reduce-scatter grads, step the shard, all-gather params
///     amp.scaler().update();
///   }
/// ```
///
/// The parameters are laid end to end, one flat space per param group and
/// dtype (fixed at the first step: bf16 weights and fp32 norms under O2 make
/// two), each padded to a multiple of the world size and cut into equal
/// shards. A step: the gradients are packed into fp32 and reduce-scattered
/// (summed; Gloo on LibTorch 1.13 has no reduce-scatter: all-reduce there),
/// averaged, clipped by their global norm if asked (max_grad_norm), the
/// local optimizer updates this rank's fp32 shard (the masters), and the
/// shards are all-gathered into the parameters in their own dtype. Both
/// collectives go through a space in pieces of at most bucket_bytes (as
/// DDP's buckets), so a step's communication buffers stay that size
/// whatever the model's. The model is not wrapped: use it without
/// DistributedDataParallel.

#include "ampx/dist.h"
#include "ampx/scaler_aware_optimizer.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ampx {
namespace dist {

/// ZeroRedundancyOptimizer's own settings (the local optimizer has its own).
struct ZeroRedundancyOptimizerOptions
    : public torch::optim::OptimizerCloneableOptions<ZeroRedundancyOptimizerOptions> {
  /// Broadcast rank 0's parameters at construction, so every rank's shard of
  /// masters starts from the same weights.
  TORCH_ARG(bool, broadcast_parameters) = true;
  /// Clip the averaged gradients to this global L2 norm before the update:
  /// the norm over every rank's shards (one scalar all-reduce), of the
  /// unscaled gradients, with torch::nn::utils::clip_grad_norm_'s
  /// coefficient max / (norm + 1e-6), at most 1. None: no clipping. (The
  /// local optimizer's own max_grad_norm would see only its shard.)
  TORCH_ARG(c10::optional<double>, max_grad_norm) = c10::nullopt;
  /// The most bytes one reduce-scatter or all-gather of a step moves, all
  /// ranks' parts together (DDP's bucket_cap_mb, 25 MiB): a space larger
  /// goes in several, each rank's part at least one element. Pieces change
  /// no result on 2 ranks; on more, Gloo's all-reduce may add the ranks'
  /// gradients in another order.
  TORCH_ARG(int64_t, bucket_bytes) = 25 * 1024 * 1024;
};

/// ZeRO stage 1 over a process group: each rank keeps the fp32 masters and the
/// optimizer state of its shard of the parameters (the top of this header).
/// Its param_groups() are the model's parameters, as given.
class ZeroRedundancyOptimizer : public torch::optim::Optimizer, public ScalerAwareOptimizer {
 public:
  /// Builds the optimizer that updates this rank's shard: one fp32 tensor per
  /// parameter dtype, the masters, each 1-D. Called once, at the first step
  /// (or load()); its options apply to all parameters.
  using OptimizerFactory =
      std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> shard)>;
  /// The same for per-parameter groups: one group per (param group, dtype)
  /// with that group's 1-D fp32 shard, in group order, carrying a clone of
  /// the group's options when it was given some (else none: the local
  /// optimizer's defaults apply).
  using GroupOptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(
      std::vector<torch::optim::OptimizerParamGroup> shard_groups)>;

  /// `params` must be the same list, in the same order, on every rank. The
  /// fp32 values of fp32 params are snapshot here (so masters keep the
  /// precision a later cast to bf16/fp16, e.g. ampx::initialize's O2, drops)
  /// until the first step cuts this rank's shards out of them.
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params, ProcessGroup group,
                          OptimizerFactory make_optimizer,
                          ZeroRedundancyOptimizerOptions options = {});
  /// Per-parameter groups (e.g. no weight decay for biases and norms): each
  /// group is sharded on its own, with its options. Groups must be the same,
  /// in the same order, on every rank.
  ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                          ProcessGroup group, GroupOptimizerFactory make_optimizer,
                          ZeroRedundancyOptimizerOptions options = {});
  ~ZeroRedundancyOptimizer() override;

  /// Unscaled gradients: reduce, step the shard, gather.
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// GradScaler's path: gradients still multiplied by `grad_scale` (if
  /// defined). `found_inf` must be the same on every rank (see
  /// synchronize_found_inf; checked): nonzero skips the step everywhere.
  void step_scaled(const at::Tensor& grad_scale, const at::Tensor& found_inf) override;

  /// The optimizer over this rank's shards (built on first use).
  torch::optim::Optimizer& local_optimizer();
  /// This rank's fp32 master shards, one per parameter dtype (built on first use).
  const std::vector<at::Tensor>& master_shards();
  /// Bytes of fp32 masters and local optimizer state this rank holds (the
  /// tensors of the local optimizer's state plus the masters).
  int64_t state_bytes();
  /// Bytes reduce-scattered and all-gathered so far by this rank.
  int64_t bytes_communicated() const;
  /// The global norm of the (unscaled, averaged) gradients at the last step
  /// that computed it (max_grad_norm set, step not skipped); none before.
  c10::optional<double> last_grad_norm() const;

  /// This rank's shards: masters, and the local optimizer's state under
  /// "local". Every rank saves its own; load() checks the rank, world size
  /// and layout first, and throws naming a mismatch without changing anything.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Reads what save() wrote on this rank (see save()).
  void load(torch::serialize::InputArchive& archive) override;

  /// Every parameter's fp32 master, whole (its shape), in the order the
  /// parameters were given: each space's shards all-gathered, so every rank
  /// holds 4 bytes a parameter more until the tensors are dropped (for an
  /// export at the end of training). Collective.
  std::vector<at::Tensor> gather_masters();

  /// Writes every parameter's fp32 master at full size, in `dtype`
  /// (float32; bfloat16 or float16, rounded to nearest), and `model`'s
  /// buffers to the safetensors file `path` on rank 0, named by `model`
  /// (whose parameters() this optimizer was built over). The shards are
  /// all-gathered a piece of bucket_bytes at a time and each piece written
  /// where it belongs, so no rank holds more than a piece: the bytes of
  /// ampx::save_safetensors() of gather_masters() by name with the
  /// buffers. Atomic (a temp file renamed over `path` once complete); an
  /// error on rank 0 throws on every rank, naming it, and leaves `path` as
  /// it was. Collective.
  void save_full_safetensors(const std::string& path, const torch::nn::Module& model,
                             const std::map<std::string, std::string>& metadata = {},
                             c10::ScalarType dtype = c10::kFloat);

  /// This rank's shards by parameter name and element range, the format of
  /// FullyShardedDataParallel::save_shard (ampx/fsdp.h): `model` (whose
  /// parameters() this optimizer was built over) names the parameters and
  /// gives the buffers; the masters, and the local optimizer's step and
  /// moments (one of ampx::optim's, in any state_format: coded moments are
  /// saved as they are kept, for a load on the same ranks, and decoded, for
  /// one on others). Any number of ranks loads them, with load_shards() or
  /// as a FullyShardedDataParallel.
  void save_shard(torch::serialize::OutputArchive& archive, const torch::nn::Module& model) const;
  /// Reads saved rank r's archive into `archive`, for r in [0, saved_world_size).
  using ShardReader = std::function<void(int64_t rank, torch::serialize::InputArchive& archive)>;
  /// Reads the shards that `saved_world_size` ranks saved (save_shard() or
  /// FullyShardedDataParallel::save_shard of the same model) through
  /// `read_shard`: this rank's share of them into its masters and the local
  /// optimizer's state, the buffers into `model`, then gathers the masters
  /// into `model`'s parameters in their dtypes, as a step ends. Everything
  /// is read and checked before anything changes: an error on any rank
  /// throws on every rank, naming the rank and its error, and changes
  /// nothing. Collective.
  void load_shards(int64_t saved_world_size, const ShardReader& read_shard,
                   torch::nn::Module& model);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dist
}  // namespace ampx
