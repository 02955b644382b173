// fsdp_worker's block-gather scenario (tests/dist/fsdp_fp8_test.cpp): a
// residual MLP of block-scaled FP8 layers (an ampx::fp8::Linear input layer,
// the blocks' and the head's Linears converted by
// ampx::fp8::convert_linears; 48 and 96 rows, so that the shards are padded
// and on 3 ranks one holds none of a weight) under FullyShardedDataParallel
// (each layer a unit), trains 5 steps in an FP8 region (bf16 autocast), the
// same from rank 0's weights in every run, with the layers' weights
// gathered in param_dtype and as their codes and scales (fp8_all_gather),
// under MXFP8 (1 x 32 and 32 x 32 weight blocks), NVFP4 (16 x 16 and 1 x 16,
// stochastic gradients, Hadamard) and FP8 blockwise (16-wide blocks), ZeRO-3
// (with and without prefetch) and ZeRO-2; and FP8 blockwise's 128-row
// blocks, which would make every weight here mostly padding. Writes, per
// run, <out>.<run> ("-eval": an evaluation in the FP8 region between each
// backward and its step): "loss <hex>" a step, rank 0's parameters
// ("param <hex>"), and "peak2 <gathered bytes>" after the second step, the
// training's "bytes <communicated>" and "peak <gathered bytes>"; then
// <out>.block-gathers: the gradients ("<recipe>-<zero>-<case> <hex>") of one
// forward and backward under MXFP8 (1 x 32, 32 x 32) and NVFP4 (16 x 16,
// 1 x 16) in ZeRO-3 and ZeRO-2 ("clean"), with an evaluation outside the
// FP8 region between them ("eval-between") or inside it ("eval-fp8-between"),
// and of two forwards summed ("twice"); and <out>.nvfp4-codes-resume
// (resume(), below).

#include "fsdp_worker.h"

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <ampx/fp8.h>
#include <ampx/fsdp.h>

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_worker {
// Named: the worker is a unity build, and fsdp_worker_fp8.cpp's names are alike.
namespace block_scenario {

constexpr int64_t kRankBatch = 16;  // NVFP4's Hadamard runs over tiles of 16 tokens
constexpr int kSteps = 5;

struct LayerImpl : torch::nn::Module {
  explicit LayerImpl(int64_t d)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        up(register_module("up", torch::nn::Linear(d, 2 * d))),
        down(register_module("down", torch::nn::Linear(2 * d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x + down(torch::gelu(up(norm(x.to(torch::kFloat)))));
  }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(Layer);

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const ampx::fp8::Recipe& recipe)
      : in(register_module("in",
                           ampx::fp8::Linear(ampx::fp8::LinearOptions(32, 48).recipe(recipe)))),
        layer0(register_module("layer0", Layer(48))),
        layer1(register_module("layer1", Layer(48))),
        head(register_module("head", torch::nn::Linear(48, 32))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = ampx::dist::sharded_forward(in, x);
    h = ampx::dist::sharded_forward(layer0, h);
    h = ampx::dist::sharded_forward(layer1, h);
    return ampx::dist::sharded_forward(head, h.to(torch::kFloat));
  }
  std::vector<std::shared_ptr<torch::nn::Module>> units() const {
    return {in.ptr(), layer0.ptr(), layer1.ptr(), head.ptr()};
  }
  ampx::fp8::Linear in;
  Layer layer0, layer1;
  torch::nn::Linear head;
};
TORCH_MODULE(Mlp);

using Run = GatherRun;
using Sharded = ShardedNet<Mlp>;

/// This rank's rows of the batch.
std::pair<torch::Tensor, torch::Tensor> rank_batch(const ampx::dist::ProcessGroup& pg) {
  torch::manual_seed(11);
  const int64_t n = kRankBatch * pg.world_size(), rank = pg.rank();
  const auto x = torch::randn({n, 32}), y = torch::randn({n, 32});
  return {x.slice(0, rank * kRankBatch, (rank + 1) * kRankBatch),
          y.slice(0, rank * kRankBatch, (rank + 1) * kRankBatch)};
}

/// The loss of one forward under bf16 autocast, in an FP8 region or not.
torch::Tensor loss_of(Mlp& model, const torch::Tensor& x, const torch::Tensor& y, bool fp8) {
  ampx::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
  ampx::fp8::Fp8AutocastGuard region(fp8);
  return torch::mse_loss(model->forward(x), y);
}

void train(const Run& run, const std::string& out, ampx::dist::ProcessGroup& pg) {
  Sharded sharded(run, pg, 200);
  auto& model = sharded.model;
  auto& fsdp = sharded.fsdp;
  ampx::optim::AdamW opt(fsdp.parameters(), ampx::optim::AdamWOptions(1e-2).weight_decay(0.01));
  const auto [x, y] = rank_batch(pg);
  std::ofstream log(out + "." + run.name);
  torch::Tensor kept;  // EvalBeforeStep::kWithGradKept's output
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    auto loss = loss_of(model, x, y, /*fp8=*/true);
    loss.backward();
    if (run.eval_before_step != EvalBeforeStep::kNone) {
      torch::AutoGradMode grad(run.eval_before_step != EvalBeforeStep::kNoGrad);
      auto out = loss_of(model, x, y, /*fp8=*/true);
      if (run.eval_before_step == EvalBeforeStep::kWithGradKept) kept = out;
    }
    opt.step();
    log << "loss " << hex(loss.item<double>()) << "\n";
    if (step == 1) log << "peak2 " << fsdp.peak_gathered_bytes() << "\n";
  }
  log << "bytes " << fsdp.bytes_communicated() << "\npeak " << fsdp.peak_gathered_bytes() << "\n";
  log_params(log, *model, fsdp, pg);
}

/// One backward's forwards that gather a unit more than once (see the top).
void gathers(const std::string& out, ampx::dist::ProcessGroup& pg) {
  const auto [x, y] = rank_batch(pg);
  std::ofstream log(out + ".block-gathers");
  const std::vector<std::pair<std::string, ampx::fp8::Recipe>> recipes{
      {"mxfp8", ampx::fp8::MXFP8BlockScaling()},
      {"mxfp8-2d", ampx::fp8::MXFP8BlockScaling().weight_2d(true)},
      {"nvfp4", ampx::fp8::NVFP4BlockScaling()},
      {"nvfp4-1d", ampx::fp8::NVFP4BlockScaling().weight_2d(false)}};
  for (const auto& [recipe_name, recipe] : recipes) {
    for (const bool zero3 : {true, false}) {
      const Run run{"", recipe, torch::kFloat, true, zero3};
      const std::string tag = recipe_name + (zero3 ? "-zero3" : "-zero2");
      {
        Sharded a(run, pg, 200);
        loss_of(a.model, x, y, true).backward();
        log_grads(log, tag + "-clean", a.fsdp);
      }
      for (const bool eval_fp8 : {false, true}) {
        Sharded b(run, pg, 200);
        auto loss = loss_of(b.model, x, y, true);
        {
          torch::NoGradGuard no_grad;
          (void)loss_of(b.model, x, y, eval_fp8);
        }
        loss.backward();
        log_grads(log, tag + (eval_fp8 ? "-eval-fp8-between" : "-eval-between"), b.fsdp);
      }
      {
        Sharded c(run, pg, 200);
        auto loss = loss_of(c.model, x, y, true) + loss_of(c.model, x, y, true);
        loss.backward();
        log_grads(log, tag + "-twice", c.fsdp);
      }
    }
  }
}

/// NVFP4's codes across load_shards(): trains the "nvfp4-codes" run, but
/// saves the shards after the second step, takes a third step, evaluates
/// in the FP8 region (gathering codes with the stepped weights' amaxes),
/// loads the shards and trains the last three steps again. Writes
/// <out>.nvfp4-codes-resume: "loss <hex>" of steps 0, 1 and 2-4 after the
/// load.
void resume(const std::string& out, ampx::dist::ProcessGroup& pg) {
  const Run run{"nvfp4-codes-resume", ampx::fp8::NVFP4BlockScaling(), torch::kFloat, true};
  Sharded s(run, pg, 200);
  ampx::optim::AdamW opt(s.fsdp.parameters(), ampx::optim::AdamWOptions(1e-2).weight_decay(0.01));
  const auto [x, y] = rank_batch(pg);
  const auto step = [&, &x = x, &y = y] {
    opt.zero_grad();
    auto loss = loss_of(s.model, x, y, /*fp8=*/true);
    loss.backward();
    opt.step();
    return loss.item<double>();
  };
  // Every rank reads every shard: in the folder all ranks write in.
  const auto shard = [&](int64_t rank) {
    return (std::filesystem::path(out).parent_path() / ("nvfp4-shard-" + std::to_string(rank)))
        .string();
  };
  std::ofstream log(out + "." + run.name);
  for (int k = 0; k < 2; ++k) log << "loss " << hex(step()) << "\n";
  {
    torch::serialize::OutputArchive archive;
    s.fsdp.save_shard(archive, &opt);
    archive.save_to(shard(pg.rank()));
  }
  (void)step();  // undone by the load (its collectives follow every rank's save)
  {
    torch::NoGradGuard no_grad;
    (void)loss_of(s.model, x, y, /*fp8=*/true);
  }
  s.fsdp.load_shards(
      pg.world_size(),
      [&](int64_t rank, torch::serialize::InputArchive& in) { in.load_from(shard(rank)); }, &opt);
  for (int k = 2; k < kSteps; ++k) log << "loss " << hex(step()) << "\n";
}

}  // namespace block_scenario

int run_block_gather(const std::string& out, ampx::dist::ProcessGroup& pg) {
  const ampx::fp8::Recipe mxfp8 = ampx::fp8::MXFP8BlockScaling();
  const ampx::fp8::Recipe mxfp8_2d = ampx::fp8::MXFP8BlockScaling().weight_2d(true);
  const ampx::fp8::Recipe nvfp4 = ampx::fp8::NVFP4BlockScaling();
  const ampx::fp8::Recipe nvfp4_1d = ampx::fp8::NVFP4BlockScaling().weight_2d(false);
  const ampx::fp8::Recipe blockwise = ampx::fp8::Float8BlockScaling().block(16);
  const ampx::fp8::Recipe blockwise128 = ampx::fp8::Float8BlockScaling();
  const std::vector<block_scenario::Run> runs{
      {"mxfp8", mxfp8, torch::kFloat, false},
      {"mxfp8-codes", mxfp8, torch::kFloat, true},
      {"mxfp8-codes-zero2", mxfp8, torch::kFloat, true, false},
      {"mxfp8-codes-noprefetch", mxfp8, torch::kFloat, true, true, false},
      {"mxfp8-bf16", mxfp8, torch::kBFloat16, false},
      {"mxfp8-bf16-codes", mxfp8, torch::kBFloat16, true},
      {"mxfp8-2d", mxfp8_2d, torch::kFloat, false},
      {"mxfp8-2d-codes", mxfp8_2d, torch::kFloat, true},
      {"nvfp4", nvfp4, torch::kFloat, false},
      {"nvfp4-codes", nvfp4, torch::kFloat, true},
      {"nvfp4-codes-eval", nvfp4, torch::kFloat, true, true, true, EvalBeforeStep::kNoGrad},
      {"nvfp4-codes-eval-grad", nvfp4, torch::kFloat, true, true, true, EvalBeforeStep::kWithGrad},
      {"nvfp4-codes-zero2-eval-grad", nvfp4, torch::kFloat, true, false, true,
       EvalBeforeStep::kWithGrad},
      {"nvfp4-codes-zero2-eval-kept", nvfp4, torch::kFloat, true, false, true,
       EvalBeforeStep::kWithGradKept},
      {"nvfp4-1d", nvfp4_1d, torch::kFloat, false},
      {"nvfp4-1d-codes", nvfp4_1d, torch::kFloat, true},
      {"nvfp4-1d-codes-zero2", nvfp4_1d, torch::kFloat, true, false},
      {"blockwise", blockwise, torch::kFloat, false},
      {"blockwise-codes", blockwise, torch::kFloat, true},
      {"blockwise128", blockwise128, torch::kFloat, false},
      {"blockwise128-codes", blockwise128, torch::kFloat, true},
  };
  for (const auto& run : runs) block_scenario::train(run, out, pg);
  block_scenario::gathers(out, pg);
  block_scenario::resume(out, pg);
  return 0;
}

}  // namespace fsdp_worker
