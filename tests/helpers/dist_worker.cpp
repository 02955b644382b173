// One rank of the data-parallel tests (tests/dist/dist_test.cpp starts 2 or 3 of
// them on loopback with torchrun's variables: RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT).
//
//   ampx_dist_worker <scenario> <out-file>
//   scenarios: train | checkpointed | accumulate | compressed | overflow | kill | bf16-probe
//              zero | zero-o2 | zero-overflow | zero-unsynced | zero-groups
//              unused-order | grads-fp32 | grads-fp16 | grads-bf16 | fp16-sum
//              fp8 | fp8-local | plan-watch | plan-watch-alone
//              mismatch-shape | mismatch-count | mismatch-dtype | mismatch-options
//              (the last rank wraps another model, or the same with other
//              options: every rank must fail at DistributedDataParallel's
//              construction)
//
// The model is a small MLP; rank r starts from its own random weights
// (DistributedDataParallel must broadcast rank 0's) and trains on its shard
// of one global batch; checkpointed trains as train with the last two
// layers under ampx::checkpoint (their gradients come from a backward inside
// backward). Writes the final parameters (train, checkpointed, accumulate,
// compressed) or one "step scale stepped" line per step (overflow).
// The ZeRO-1 scenarios (zero*): dist_worker_zero.cpp; plan-watch*:
// dist_worker_plan.cpp; what they share: dist_worker.h.

#include "dist_worker.h"

#include <ampx/ampx.h>
#include <ampx/debug.h>
#include <ampx/dist.h>
#include <ampx/fp8/autocast.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dist_worker {

torch::nn::Sequential make_model(int64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 4));
}

torch::nn::Sequential make_norm_model(int64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(
      torch::nn::Linear(8, 32), torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})),
      torch::nn::Tanh(), torch::nn::Linear(32, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
}

std::pair<torch::Tensor, torch::Tensor> batch_shard(int64_t rank, int64_t world) {
  torch::manual_seed(7);
  const auto x = torch::randn({kGlobalBatch, 8}), y = torch::randn({kGlobalBatch, 4});
  const int64_t shard = kGlobalBatch / world;
  return {x.slice(0, rank * shard, (rank + 1) * shard),
          y.slice(0, rank * shard, (rank + 1) * shard)};
}

void write_params(const torch::nn::Sequential& model, const std::string& path) {
  std::ofstream out(path, std::ios::binary);
  for (const auto& p : model->parameters()) {
    auto c = p.detach().to(torch::kFloat).contiguous();
    out.write(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
  }
}

}  // namespace dist_worker

namespace {

using dist_worker::batch_shard;
using dist_worker::kSteps;
using dist_worker::make_model;
using dist_worker::write_params;

// Two branches, each parameter its own bucket; rank 0 uses only the first,
// rank 1 only the second, so their buckets fill in opposite orders during
// backward (the rest at synchronize, find_unused_parameters). Writes the
// averaged gradients after one backward.
int run_unused_order(const std::string& out, ampx::dist::ProcessGroup pg) {
  torch::manual_seed(5);
  torch::nn::Linear a(8, 4), b(8, 4);
  torch::nn::Sequential model(a, b);  // a holder: a's parameters, then b's
  ampx::dist::DistributedDataParallel ddp(model.ptr(), pg,
                                          ampx::dist::DistributedDataParallelOptions()
                                              .bucket_cap_bytes(1)
                                              .first_bucket_cap_bytes(1)
                                              .find_unused_parameters(true));
  torch::manual_seed(6 + pg.rank());
  const auto x = torch::randn({3, 8}), y = torch::randn({3, 4});
  torch::mse_loss(pg.rank() == 0 ? a->forward(x) : b->forward(x), y).backward();
  ddp.synchronize();
  std::ofstream file(out, std::ios::binary);
  for (const auto& p : model->parameters()) {
    auto g = p.grad().contiguous();
    file.write(static_cast<const char*>(g.data_ptr()), g.numel() * g.element_size());
  }
  return 0;
}

// One backward on this rank's shard and one synchronize() with gradients
// communicated in the scenario's dtype (grads-fp32, -fp16, -bf16): writes the
// averaged fp32 gradients, parameter by
// parameter (the model of rank 0, which DDP broadcasts).
int run_grads(const std::string& scenario, const std::string& out, ampx::dist::ProcessGroup pg) {
  const auto dtype = scenario == "grads-fp32"   ? torch::kFloat
                     : scenario == "grads-fp16" ? torch::kHalf
                                                : torch::kBFloat16;
  auto model = make_model(100 + pg.rank());
  ampx::dist::DistributedDataParallelOptions options;
  options.bucket_cap_bytes(512);
  options.communication_dtype(dtype);
  ampx::dist::DistributedDataParallel ddp(model.ptr(), pg, options);
  const auto batch = batch_shard(pg.rank(), pg.world_size());
  torch::mse_loss(model->forward(batch.first), batch.second).backward();
  ddp.synchronize();
  std::ofstream file(out, std::ios::binary);
  for (const auto& p : model->parameters()) {
    auto g = p.grad().to(torch::kFloat).contiguous();
    file.write(static_cast<const char*>(g.data_ptr()), g.numel() * g.element_size());
  }
  return 0;
}

// fp16-sum: fp16 parameters (O2's with --dtype fp16) whose gradient is
// 40000 on every rank, under DDP on its own dtype: the sum of two is past
// fp16's largest (65504), their mean is not. Writes each gradient as float32.
int run_fp16_sum(const std::string& out, ampx::dist::ProcessGroup pg) {
  struct Weights : torch::nn::Module {
    at::Tensor w = register_parameter("w", torch::zeros({8}, torch::kHalf));
  };
  auto model = std::make_shared<Weights>();
  ampx::dist::DistributedDataParallel ddp(model, pg);
  (model->w * 40000.0).sum().backward();
  ddp.synchronize();
  std::ofstream file(out, std::ios::binary);
  auto g = model->w.grad().to(torch::kFloat).contiguous();
  file.write(static_cast<const char*>(g.data_ptr()), g.numel() * g.element_size());
  return model->w.grad().scalar_type() == torch::kHalf ? 0 : 2;
}

// FP8 Linears (every layer converted, delayed scaling, history 4) under DDP:
// "fp8" max-reduces the amaxes over the group (TE's reduce_amax), "fp8-local"
// keeps each rank's. Writes the parameters, then every FP8 buffer (float32).
int run_fp8(const std::string& scenario, const std::string& out,
            const ampx::dist::ProcessGroup& pg) {
  const int64_t rank = pg.rank(), world = pg.world_size();
  auto model = make_model(100 + rank);
  const auto converted = ampx::fp8::convert_linears(
      *model, ampx::fp8::ConvertOptions()
                  .recipe(ampx::fp8::DelayedScaling().amax_history_len(4))
                  .filter([](const std::string&, const torch::nn::LinearImpl&) { return true; }));
  if (converted.size() != 3) return 4;
  ampx::dist::DistributedDataParallel ddp(model.ptr(), pg);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  const auto batch = batch_shard(rank, world);
  ampx::fp8::Fp8AutocastOptions region;
  if (scenario == "fp8") region.amax_reduction_group(&pg);
  for (int step = 0; step < 6; ++step) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      ampx::fp8::Fp8AutocastGuard fp8(region);
      loss = torch::mse_loss(model->forward(batch.first).to(torch::kFloat), batch.second);
      fp8.finish();
    }
    loss.backward();
    ddp.synchronize();
    opt.step();
  }
  write_params(model, out);
  std::ofstream file(out, std::ios::binary | std::ios::app);
  for (const auto& b : model->named_buffers()) {
    if (b.key().find("fp8_") == std::string::npos) continue;
    auto c = b.value().detach().to(torch::kFloat).contiguous();
    file.write(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
  }
  return 0;
}

/// The DDP options of the train-like scenarios: several buckets, the
/// scenario's communication dtype; on the last rank (`last`), the mismatch-*
/// scenarios' other model (mismatch-shape, -count, -dtype) or options.
ampx::dist::DistributedDataParallelOptions ddp_options(const std::string& scenario, bool last,
                                                       torch::nn::Sequential& model) {
  ampx::dist::DistributedDataParallelOptions options;
  options.bucket_cap_bytes(512);  // several buckets for this small model
  if (scenario == "compressed") {
    // LibTorch 1.13's Gloo sums no bfloat16 (DDP says so); 2.x's does.
    const bool v1 = std::string(ampx::torch_version()).rfind("1.", 0) == 0;
    options.communication_dtype(v1 ? torch::kHalf : torch::kBFloat16);
  }
  if (scenario == "bf16-probe") options.communication_dtype(torch::kBFloat16);
  if (last) {
    if (scenario == "mismatch-shape") {  // 5 outputs instead of 4
      model = torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(),
                                    torch::nn::Linear(32, 16), torch::nn::Tanh(),
                                    torch::nn::Linear(16, 5));
    }
    if (scenario == "mismatch-count") model->push_back(torch::nn::Linear(4, 4));
    if (scenario == "mismatch-dtype") model->to(torch::kBFloat16);  // O2 on one rank only
    if (scenario == "mismatch-options") options.bucket_cap_bytes(1024);
  }
  return options;
}

/// accumulate's backward: two micro-batches, the first only accumulates
/// (no_sync), the second reduces.
void accumulate_step(torch::nn::Sequential& model, ampx::dist::DistributedDataParallel& ddp,
                     const torch::Tensor& xs, const torch::Tensor& ys) {
  const int64_t half = xs.size(0) / 2;
  {
    auto guard = ddp.no_sync();
    (torch::mse_loss(model->forward(xs.slice(0, 0, half)), ys.slice(0, 0, half)) / 2).backward();
  }
  (torch::mse_loss(model->forward(xs.slice(0, half)), ys.slice(0, half)) / 2).backward();
  ddp.synchronize();
}

/// The model's output on `x`; checkpointed: the layers after the first Tanh
/// (model: Linear, Tanh, Linear, Tanh, Linear) under ampx::checkpoint.
torch::Tensor forward(const std::string& scenario, torch::nn::Sequential& model,
                      const torch::Tensor& x) {
  if (scenario != "checkpointed") return model->forward(x);
  const auto h = torch::tanh(model->at<torch::nn::LinearImpl>(0).forward(x));
  return ampx::checkpoint(
      [&model](const torch::Tensor& t) {
        return model->at<torch::nn::LinearImpl>(4).forward(
            torch::tanh(model->at<torch::nn::LinearImpl>(2).forward(t)));
      },
      h);
}

/// Prints how many non-finite values the guard saw and its first report.
void print_nonfinite(const ampx::debug::NonFiniteGuard& guard) {
  std::cout << "nonfinite " << guard.count() << std::endl;
  if (!guard.reports().empty()) {
    const auto& r = guard.reports().front();
    std::cout << "first " << r.op << " " << ampx::debug::to_string(r.direction) << " step "
              << r.step << (r.propagated() ? " propagated" : " created") << std::endl;
  }
}

int run(std::string scenario, const std::string& out) {
  // "guarded-<scenario>": the same under ampx::debug::NonFiniteGuard (warn
  // mode); the first report goes to stdout.
  std::unique_ptr<ampx::debug::NonFiniteGuard> guard;
  if (scenario.rfind("guarded-", 0) == 0) {
    scenario = scenario.substr(8);
    guard = std::make_unique<ampx::debug::NonFiniteGuard>(
        ampx::debug::NonFiniteOptions().action(ampx::debug::NonFiniteAction::kWarn));
  }
  ampx::dist::InitOptions init;
  init.timeout(std::chrono::seconds(scenario == "kill" ? 5 : 60));
  auto pg = ampx::dist::init_process_group(init);
  if (scenario == "zero-groups") return dist_worker::run_zero_groups(out, pg);
  if (scenario == "unused-order") return run_unused_order(out, pg);
  if (scenario.rfind("grads-", 0) == 0) return run_grads(scenario, out, pg);
  if (scenario == "fp16-sum") return run_fp16_sum(out, pg);
  if (scenario.rfind("zero", 0) == 0) return dist_worker::run_zero(scenario, out, pg);
  if (scenario.rfind("fp8", 0) == 0) return run_fp8(scenario, out, pg);
  if (scenario.rfind("plan-watch", 0) == 0) return dist_worker::run_plan_watch(scenario, out, pg);
  const int64_t rank = pg.rank(), world = pg.world_size();
  auto model = make_model(100 + rank);  // different on each rank: DDP broadcasts rank 0's
  const auto options = ddp_options(scenario, rank == world - 1, model);
  ampx::dist::DistributedDataParallel ddp(model.ptr(), pg, options);
  ampx::debug::name_modules(*model);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  ampx::GradScaler scaler(ampx::GradScalerOptions().init_scale(1024.0).growth_interval(1000));

  const auto batch = batch_shard(rank, world);
  const auto& xs = batch.first;
  const auto& ys = batch.second;
  std::ofstream log(scenario.rfind("overflow", 0) == 0 ? out : "/dev/null");

  for (int step = 0; step < kSteps; ++step) {
    if (guard) guard->set_step(step);
    opt.zero_grad();
    if (scenario == "kill" && rank == 1 && step == 2) std::_Exit(3);  // dies mid-training
    if (scenario == "accumulate") {
      accumulate_step(model, ddp, xs, ys);
      opt.step();
      continue;
    }
    auto loss = torch::mse_loss(forward(scenario, model, xs), ys);
    if (scenario == "overflow" && rank == 1 && step == 3) loss = loss * INFINITY;
    // An op that makes the inf itself (the scalars are finite).
    if (scenario == "overflow-op" && rank == 1 && step == 3) loss = loss * 1e30 * 1e30;
    scaler.scale(loss).backward();
    ddp.synchronize();
    const bool stepped = static_cast<bool>(scaler.step(opt));
    scaler.update();
    log << step << " " << scaler.get_scale() << " " << stepped << "\n";
  }
  if (scenario.rfind("overflow", 0) != 0) write_params(model, out);
  std::cout << "bytes " << ddp.bytes_communicated() << std::endl;
  if (guard) print_nonfinite(*guard);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: ampx_dist_worker <scenario> <out-file>\n");
    return 2;
  }
  try {
    return run(argv[1], argv[2]);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
  }
  return 1;
}
