// fsdp_worker's fp8-gather scenario (tests/dist/fsdp_fp8_test.cpp): a residual
// MLP whose input layer is an ampx::fp8::Linear and whose blocks' Linears
// are converted (ampx::fp8::convert_linears), under
// FullyShardedDataParallel (each layer a unit), trains 5 steps in an FP8
// region (bf16 autocast), the same from rank 0's weights in every run, with
// the FP8 layers' weights gathered in param_dtype (float32 or bfloat16) and
// as their codes (fp8_all_gather), under delayed scaling (amaxes reduced
// over the group) and current scaling, ZeRO-3 (with and without prefetch)
// and ZeRO-2. Each run then evaluates once with the region ended after the
// first block (the second block, prefetched as codes, computes outside
// FP8; "-eval" runs also evaluate in the region between each backward and
// its step). Writes, per run, <out>.<run>: "loss <hex>" a step, "eval <hex>",
// rank 0's parameters ("param <hex>"), the input layer's weight scale after
// training ("scale <hex>"), and the training's "bytes <communicated>" and
// "peak <gathered bytes>"; then <out>.gathers (gathers(), below).

#include "fsdp_worker.h"

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <ampx/fp8.h>
#include <ampx/fsdp.h>

#include <torch/torch.h>

#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_worker {
namespace {

constexpr int64_t kGlobalBatch = 12;
constexpr int kSteps = 5;

/// The FP8 region of the forward in flight: the model may end it early.
std::optional<ampx::fp8::Fp8AutocastGuard> g_region;

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        up(register_module("up", torch::nn::Linear(d, 2 * d))),
        down(register_module("down", torch::nn::Linear(2 * d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x + down(torch::gelu(up(norm(x.to(torch::kFloat)))));
  }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(Block);

/// The input layer's unit: an ampx::fp8::Linear that may run with FP8
/// turned off inside the unit (`fp8_off`, a misuse the layer refuses).
struct InputImpl : torch::nn::Module {
  explicit InputImpl(const ampx::fp8::Recipe& recipe)
      : fc(register_module("fc",
                           ampx::fp8::Linear(ampx::fp8::LinearOptions(16, 32).recipe(recipe)))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    std::optional<ampx::fp8::Fp8AutocastGuard> off;
    if (fp8_off) off.emplace(false);
    return fc(x);
  }
  ampx::fp8::Linear fc;
  bool fp8_off = false;
};
TORCH_MODULE(Input);

struct NetImpl : torch::nn::Module {
  explicit NetImpl(const ampx::fp8::Recipe& recipe)
      : in(register_module("in", Input(recipe))),
        block0(register_module("block0", Block(32))),
        block1(register_module("block1", Block(32))),
        head(register_module("head", torch::nn::Linear(32, 8))) {}
  torch::Tensor forward(const torch::Tensor& x, bool end_region_early) {
    auto h = ampx::dist::sharded_forward(in, x);
    h = ampx::dist::sharded_forward(block0, h);
    if (end_region_early && g_region) g_region->finish();
    h = ampx::dist::sharded_forward(block1, h);
    return ampx::dist::sharded_forward(head, h.to(torch::kFloat));
  }
  std::vector<std::shared_ptr<torch::nn::Module>> units() const {
    return {in.ptr(), block0.ptr(), block1.ptr(), head.ptr()};
  }
  Input in;
  Block block0, block1;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

using Run = GatherRun;
using Sharded = ShardedNet<Net>;

/// This rank's rows of the global batch.
std::pair<torch::Tensor, torch::Tensor> batch_of(const ampx::dist::ProcessGroup& pg) {
  torch::manual_seed(7);
  const auto x = torch::randn({kGlobalBatch, 16}), y = torch::randn({kGlobalBatch, 8});
  const int64_t shard = kGlobalBatch / pg.world_size(), rank = pg.rank();
  return {x.slice(0, rank * shard, (rank + 1) * shard),
          y.slice(0, rank * shard, (rank + 1) * shard)};
}

/// The loss of one forward under bf16 autocast, in an FP8 region (`fp8`;
/// its amaxes reduced over `group` where given) or not.
torch::Tensor loss_of(Net& model, const torch::Tensor& x, const torch::Tensor& y, bool fp8,
                      const ampx::dist::ProcessGroup* group, bool end_region_early = false) {
  ampx::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
  if (fp8) g_region.emplace(ampx::fp8::Fp8AutocastOptions().amax_reduction_group(group));
  auto loss = torch::mse_loss(model->forward(x, end_region_early), y);
  if (g_region) g_region->finish();
  g_region.reset();
  return loss;
}

void train(const Run& run, const std::string& out, ampx::dist::ProcessGroup& pg) {
  Sharded sharded(run, pg, 100);
  auto& model = sharded.model;
  auto& fsdp = sharded.fsdp;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (run.torch_sgd) {
    optimizer =
        std::make_unique<torch::optim::SGD>(fsdp.parameters(), torch::optim::SGDOptions(0.1));
  } else {
    optimizer = std::make_unique<ampx::optim::AdamW>(
        fsdp.parameters(), ampx::optim::AdamWOptions(1e-2).weight_decay(0.01));
  }
  auto& opt = *optimizer;
  const auto [x, y] = batch_of(pg);
  const auto* group = run.recipe.is_delayed() ? &pg : nullptr;
  const auto forward = [&](bool end_region_early) {
    return loss_of(model, x, y, /*fp8=*/true, group, end_region_early);
  };
  std::ofstream log(out + "." + run.name);
  torch::Tensor kept;  // EvalBeforeStep::kWithGradKept's output
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    auto loss = forward(false);
    loss.backward();
    if (run.eval_before_step != EvalBeforeStep::kNone) {
      torch::AutoGradMode grad(run.eval_before_step != EvalBeforeStep::kNoGrad);
      auto out = forward(false);
      if (run.eval_before_step == EvalBeforeStep::kWithGradKept) kept = out;
    }
    opt.step();
    log << "loss " << hex(loss.item<double>()) << "\n";
  }
  // The training's communication, before the evaluation gathers again.
  log << "bytes " << fsdp.bytes_communicated() << "\npeak " << fsdp.peak_gathered_bytes() << "\n";
  {
    torch::NoGradGuard no_grad;
    log << "eval " << hex(forward(true).item<double>()) << "\n";
  }
  log_params(log, *model, fsdp, pg);
  log << "scale " << hex(model->in->fc->scaling().weight->scale().item<double>()) << "\n";
}

/// The first line of c10::Error `fn` throws ("none" without one).
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string text = e.what_without_backtrace();
    return text.substr(0, text.find('\n'));
  }
  return "none";
}

/// One backward's forwards that gather a unit more than once (delayed
/// scaling, amaxes recorded at once, so the weight's scale moves between
/// them), and the misuses that are refused. Writes <out>.gathers:
/// "<zero>-<case> <hex>" gradients for zero3 and zero2 of: "clean" (one
/// forward and its backward), "eval-between" (an evaluation outside the
/// FP8 region between them) and "twice" (two forwards in two regions, one
/// backward of their sum); "refused-off <error>" (the input layer run with
/// FP8 off inside its unit) and "refused-two-ways <error>" (a forward
/// outside the region before the backward of one inside it).
void gathers(const std::string& out, ampx::dist::ProcessGroup& pg) {
  const ampx::fp8::Recipe delayed = ampx::fp8::DelayedScaling().amax_history_len(4);
  const auto [x, y] = batch_of(pg);
  std::ofstream log(out + ".gathers");
  for (const bool zero3 : {true, false}) {
    const Run run{"", delayed, torch::kFloat, true, zero3};
    const std::string zero = zero3 ? "zero3" : "zero2";
    {
      Sharded a(run, pg, 100);
      loss_of(a.model, x, y, true, nullptr).backward();
      log_grads(log, zero + "-clean", a.fsdp);
    }
    {
      Sharded b(run, pg, 100);
      auto loss = loss_of(b.model, x, y, true, nullptr);
      {
        torch::NoGradGuard no_grad;
        (void)loss_of(b.model, x, y, false, nullptr);
      }
      loss.backward();
      log_grads(log, zero + "-eval-between", b.fsdp);
    }
    {
      Sharded c(run, pg, 100);
      auto loss = loss_of(c.model, x, y, true, nullptr) + loss_of(c.model, x, y, true, nullptr);
      loss.backward();
      log_grads(log, zero + "-twice", c.fsdp);
    }
  }
  const Run run{"", delayed, torch::kFloat, true};
  {
    Sharded d(run, pg, 100);
    d.model->in->fp8_off = true;
    log << "refused-off " << error_of([&] { (void)loss_of(d.model, x, y, true, nullptr); }) << "\n";
  }
  {
    Sharded e(run, pg, 100);
    auto inside = loss_of(e.model, x, y, true, nullptr);
    log << "refused-two-ways " << error_of([&] { (void)loss_of(e.model, x, y, false, nullptr); })
        << "\n";
  }
}

}  // namespace

int run_fp8_gather(const std::string& out, ampx::dist::ProcessGroup& pg) {
  const ampx::fp8::Recipe delayed = ampx::fp8::DelayedScaling().amax_history_len(4);
  const ampx::fp8::Recipe current = ampx::fp8::CurrentScaling();
  constexpr auto kNoGrad = EvalBeforeStep::kNoGrad, kWithGrad = EvalBeforeStep::kWithGrad;
  constexpr auto kKept = EvalBeforeStep::kWithGradKept, kNone = EvalBeforeStep::kNone;
  const std::vector<Run> runs{
      {"delayed-fp32", delayed, torch::kFloat, false},
      {"delayed-fp32-codes", delayed, torch::kFloat, true},
      {"delayed-fp32-codes-zero2", delayed, torch::kFloat, true, false},
      {"delayed-fp32-codes-noprefetch", delayed, torch::kFloat, true, true, false},
      {"delayed-bf16", delayed, torch::kBFloat16, false},
      {"delayed-bf16-codes", delayed, torch::kBFloat16, true},
      {"current-fp32", current, torch::kFloat, false},
      {"current-fp32-codes", current, torch::kFloat, true},
      {"current-fp32-codes-eval", current, torch::kFloat, true, true, true, kNoGrad},
      {"current-fp32-codes-eval-grad", current, torch::kFloat, true, true, true, kWithGrad},
      {"current-fp32-codes-zero2-eval-grad", current, torch::kFloat, true, false, true, kWithGrad},
      {"current-fp32-zero2-eval-grad", current, torch::kFloat, false, false, true, kWithGrad},
      {"current-fp32-codes-zero2-eval-kept", current, torch::kFloat, true, false, true, kKept},
      {"current-fp32-sgd", current, torch::kFloat, false, true, true, kNone, true},
      {"current-fp32-zero2-eval-grad-sgd", current, torch::kFloat, false, false, true, kWithGrad,
       true},
      {"current-fp32-zero2-eval-kept", current, torch::kFloat, false, false, true, kKept},
      {"delayed-fp32-eval-grad", delayed, torch::kFloat, false, true, true, kWithGrad},
      {"delayed-fp32-codes-eval-grad", delayed, torch::kFloat, true, true, true, kWithGrad},
  };
  for (const auto& run : runs) train(run, out, pg);
  gathers(out, pg);
  return 0;
}

}  // namespace fsdp_worker
