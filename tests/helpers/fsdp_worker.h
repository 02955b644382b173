#pragma once

// What the sources of ampx_fsdp_worker share: the scenarios that main()
// (fsdp_worker.cpp) runs from the other files, the exact text of a number
// that every scenario writes its results in, and the FP8 scenarios' runs
// (GatherRun) and sharded models (ShardedNet).

#include <ampx/dist.h>
#include <ampx/fp8.h>
#include <ampx/fsdp.h>

#include <torch/nn/module.h>
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

namespace fsdp_worker {

/// An evaluation in the FP8 region after each backward, before the
/// optimizer's step: none, under torch::NoGradGuard, or with gradients
/// recorded (a forward no backward follows), its output dropped at once or
/// kept (its graph alive) until after the next step's forward.
enum class EvalBeforeStep { kNone, kNoGrad, kWithGrad, kWithGradKept };

/// A training of the fp8-gather and block-gather scenarios: the FP8 recipe,
/// and how the wrapper gathers and shards.
struct GatherRun {
  std::string name;
  ampx::fp8::Recipe recipe;
  c10::ScalarType param_dtype;
  bool codes;                         // fp8_all_gather
  bool reshard_after_forward = true;  // ZeRO-3; false: ZeRO-2
  bool prefetch = true;
  EvalBeforeStep eval_before_step = EvalBeforeStep::kNone;
  bool torch_sgd = false;  // LibTorch's SGD, which writes through .data(), not ampx's AdamW
};

/// A `Net` of `run`'s recipe (made from it, its torch::nn::Linears then
/// converted; `units()` lists its units) sharded as `run` says. The ranks
/// draw other weights (`seed` plus the rank); the wrapper gives every rank
/// rank 0's.
template <typename Net>
struct ShardedNet {
  ShardedNet(const GatherRun& run, ampx::dist::ProcessGroup& pg, uint64_t seed)
      : model([&] {
          torch::manual_seed(seed + static_cast<uint64_t>(pg.rank()));
          Net net(run.recipe);
          ampx::fp8::convert_linears(*net, ampx::fp8::ConvertOptions().recipe(run.recipe));
          return net;
        }()),
        fsdp(model.ptr(), pg, model->units(),
             ampx::dist::FullyShardedDataParallelOptions()
                 .param_dtype(run.param_dtype)
                 .fp8_all_gather(run.codes)
                 .reshard_after_forward(run.reshard_after_forward)
                 .prefetch(run.prefetch)) {}
  Net model;
  ampx::dist::FullyShardedDataParallel fsdp;
};

/// `v` exactly, as C's %a writes it.
std::string hex(double v);
/// This rank's gradient pieces, a "<tag> <hex>" line an element.
void log_grads(std::ostream& log, const std::string& tag,
               const ampx::dist::FullyShardedDataParallel& fsdp);
/// Rank 0: the model's full parameters (collective), a "param <hex>" line an element.
void log_params(std::ostream& log, const torch::nn::Module& model,
                ampx::dist::FullyShardedDataParallel& fsdp, const ampx::dist::ProcessGroup& pg);

/// The export scenario (fsdp_worker_export.cpp).
int run_export(const std::string& out, ampx::dist::ProcessGroup& pg);
/// The zero-pieces scenario (fsdp_worker_zero_pieces.cpp).
int run_zero_pieces(const std::string& out, ampx::dist::ProcessGroup& pg);
/// The fp8-gather scenario (fsdp_worker_fp8.cpp).
int run_fp8_gather(const std::string& out, ampx::dist::ProcessGroup& pg);
/// The block-gather scenario (fsdp_worker_block.cpp).
int run_block_gather(const std::string& out, ampx::dist::ProcessGroup& pg);

}  // namespace fsdp_worker
