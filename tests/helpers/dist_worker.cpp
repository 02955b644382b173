// One rank of the data-parallel tests (tests/dist/dist_test.cpp starts 2 or 3 of
// them on loopback with torchrun's variables: RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT).
//
//   ampx_dist_worker <scenario> <out-file>
//   scenarios: train | accumulate | compressed | overflow | kill | bf16-probe
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
// of one global batch. Writes the final parameters (train, accumulate,
// compressed) or one "step scale stepped" line per step (overflow).

#include <ampx/ampx.h>
#include <ampx/debug.h>
#include <ampx/dist.h>
#include <ampx/fp8/autocast.h>
#include <ampx/serialize.h>
#include <ampx/zero.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace dist_worker {
/// The plan-watch scenarios (dist_worker_plan.cpp).
int run_plan_watch(const std::string& scenario, const std::string& out,
                   ampx::dist::ProcessGroup pg);
}  // namespace dist_worker

namespace {

constexpr int64_t kGlobalBatch = 12;
constexpr int kSteps = 20;

torch::nn::Sequential make_model(int64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 4));
}

// The same with a LayerNorm, which O2 keeps in fp32 (two parameter dtypes).
torch::nn::Sequential make_norm_model(int64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(
      torch::nn::Linear(8, 32), torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})),
      torch::nn::Tanh(), torch::nn::Linear(32, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
}

// This rank's rows (inputs, targets) of the global batch, which is the same
// on every rank (seed 7).
std::pair<torch::Tensor, torch::Tensor> batch_shard(int64_t rank, int64_t world) {
  torch::manual_seed(7);
  const auto x = torch::randn({kGlobalBatch, 8}), y = torch::randn({kGlobalBatch, 4});
  const int64_t shard = kGlobalBatch / world;
  return {x.slice(0, rank * shard, (rank + 1) * shard),
          y.slice(0, rank * shard, (rank + 1) * shard)};
}

// Every parameter as float32, in order.
void write_params(const torch::nn::Sequential& model, const std::string& path) {
  std::ofstream out(path, std::ios::binary);
  for (const auto& p : model->parameters()) {
    auto c = p.detach().to(torch::kFloat).contiguous();
    out.write(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
  }
}

using Factory = ampx::dist::ZeroRedundancyOptimizer::OptimizerFactory;
const ampx::optim::AdamWOptions kAdamW = ampx::optim::AdamWOptions(1e-2).weight_decay(0.01);
const Factory kAdamWFactory = [](std::vector<torch::Tensor> shard) {
  return std::make_unique<ampx::optim::AdamW>(std::move(shard), kAdamW);
};

// Bytes of fp32 masters and moments an unsharded ampx optimizer holds.
int64_t state_bytes(const ampx::optim::MixedPrecisionOptimizer& opt,
                    const std::vector<torch::Tensor>& params) {
  int64_t total = 0;
  for (const auto& p : params) {
    for (const auto& t : {opt.master(p), opt.exp_avg(p), opt.exp_avg_sq(p)}) {
      if (t.defined()) total += t.numel() * t.element_size();
    }
  }
  return total;
}

// ZeRO-1 against unsharded DDP with the same optimizer, each rank on its
// shard of the batch; writes ZeRO's parameters to `out`, DDP's to
// `out`.ref, and a run saved after 10 steps and resumed into a fresh
// model to `out`.resumed.
int run_zero(const std::string& scenario, const std::string& out, ampx::dist::ProcessGroup pg) {
  const int64_t rank = pg.rank(), world = pg.world_size();
  const auto batch = batch_shard(rank, world);
  const auto& xs = batch.first;
  const auto& ys = batch.second;
  const bool o2 = scenario == "zero-o2";
  auto make = [&](int64_t seed) { return o2 ? make_norm_model(seed) : make_model(seed); };

  if (scenario == "zero-overflow" || scenario == "zero-unsynced") {
    auto model = make(100 + rank);
    ampx::dist::ZeroRedundancyOptimizer opt(model->parameters(), pg, kAdamWFactory);
    ampx::GradScaler scaler(ampx::GradScalerOptions().init_scale(1024.0).growth_interval(1000));
    if (scenario == "zero-overflow") ampx::dist::synchronize_found_inf(scaler, pg);
    std::ofstream log(out);
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      auto loss = torch::mse_loss(model->forward(xs), ys);
      if (rank == 1 && step == 3) loss = loss * INFINITY;
      scaler.scale(loss).backward();
      const bool stepped = static_cast<bool>(scaler.step(opt));
      scaler.update();
      log << step << " " << scaler.get_scale() << " " << stepped << "\n";
    }
    return 0;
  }

  // ZeRO-1: O2 casts the model after the optimizer has snapshot the fp32 weights.
  const auto level = ampx::AmpOptions(o2 ? ampx::OptLevel::O2 : ampx::OptLevel::O0);
  auto train_zero = [&](torch::nn::Sequential& model, ampx::AmpSession& amp,
                        ampx::dist::ZeroRedundancyOptimizer& opt, int from, int to) {
    for (int step = from; step < to; ++step) {
      opt.zero_grad();
      torch::Tensor loss;
      {
        auto guard = amp.forward_guard();
        loss = torch::mse_loss(model->forward(amp.cast_input(xs)).to(torch::kFloat), ys);
      }
      amp.scaler().scale(loss).backward();
      amp.scaler().step(opt);
      amp.scaler().update();
    }
  };
  auto model = make(100 + rank);
  ampx::dist::ZeroRedundancyOptimizer zero(model->parameters(), pg, kAdamWFactory);
  auto amp_zero = ampx::initialize(model.ptr(), {}, level);
  train_zero(model, amp_zero, zero, 0, kSteps);
  write_params(model, out);

  // Unsharded: ampx AdamW (with fp32 masters under O2) and DDP, built before
  // initialize() so that the masters are captured from rank 0's weights.
  auto ref = make(100 + rank);
  ampx::dist::DistributedDataParallel ddp(ref.ptr(), pg);
  ampx::optim::AdamW adamw(ref->parameters(), kAdamW);
  auto amp = ampx::initialize(ref.ptr(), {&adamw}, level);
  for (int step = 0; step < kSteps; ++step) {
    adamw.zero_grad();
    torch::Tensor loss;
    {
      auto guard = amp.forward_guard();
      loss = torch::mse_loss(ref->forward(amp.cast_input(xs)).to(torch::kFloat), ys);
    }
    amp.scaler().scale(loss).backward();
    ddp.synchronize();
    amp.scaler().step(adamw);
    amp.scaler().update();
  }
  write_params(ref, out + ".ref");
  std::cout << "state_bytes " << zero.state_bytes() << " " << state_bytes(adamw, ref->parameters())
            << std::endl;

  // Stop after 10 steps, save each rank's shard, resume into fresh objects.
  // Through files, as a user keeps them: ampx::save_archive, ampx::load_archive.
  auto first = make(100 + rank);
  const std::string shard = out + ".shard";
  {
    ampx::dist::ZeroRedundancyOptimizer opt(first->parameters(), pg, kAdamWFactory);
    auto amp_first = ampx::initialize(first.ptr(), {}, level);
    train_zero(first, amp_first, opt, 0, kSteps / 2);
    torch::serialize::OutputArchive archive;
    opt.save(archive);
    ampx::save_archive(archive, shard);
  }
  auto second = make(200 + rank);  // other weights: everything must come from the save
  ampx::dist::ZeroRedundancyOptimizer opt(second->parameters(), pg, kAdamWFactory);
  {
    torch::NoGradGuard no_grad;
    auto to = second->parameters();
    auto from = first->parameters();
    for (size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i].to(torch::kFloat));
  }
  auto amp_resumed = ampx::initialize(second.ptr(), {}, level);
  torch::serialize::InputArchive archive;
  ampx::load_archive(archive, shard);
  opt.load(archive);
  train_zero(second, amp_resumed, opt, kSteps / 2, kSteps);
  write_params(second, out + ".resumed");
  return 0;
}

// ZeRO-1 with two param groups (weights: decay; biases: twice the lr, no
// decay) and global gradient clipping, under a GradScaler, against DDP +
// ampx AdamW over the same groups clipping the whole gradient. Writes
// ZeRO's parameters to `out`, DDP's to `out`.ref, a run saved after 10 steps
// and resumed to `out`.resumed, and per step ZeRO's global norm and the norm
// of DDP's averaged gradients to `out`.norms.
constexpr double kMaxNorm = 0.05;

std::vector<torch::optim::OptimizerParamGroup> weight_and_bias_groups(
    const torch::nn::Sequential& model) {
  std::vector<torch::Tensor> weights, biases;
  for (const auto& p : model->named_parameters()) {
    (p.key().find("bias") != std::string::npos ? biases : weights).push_back(p.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(weights, std::make_unique<ampx::optim::AdamWOptions>(
                                   ampx::optim::AdamWOptions(1e-2).weight_decay(0.1)));
  groups.emplace_back(biases, std::make_unique<ampx::optim::AdamWOptions>(
                                  ampx::optim::AdamWOptions(2e-2).weight_decay(0.0)));
  return groups;
}

int run_zero_groups(const std::string& out, ampx::dist::ProcessGroup pg) {
  const int64_t rank = pg.rank(), world = pg.world_size();
  const auto batch = batch_shard(rank, world);
  const auto& xs = batch.first;
  const auto& ys = batch.second;
  const auto options = ampx::dist::ZeroRedundancyOptimizerOptions().max_grad_norm(kMaxNorm);
  const ampx::dist::ZeroRedundancyOptimizer::GroupOptimizerFactory factory =
      [](std::vector<torch::optim::OptimizerParamGroup> groups) {
        return std::make_unique<ampx::optim::AdamW>(std::move(groups),
                                                    ampx::optim::AdamWOptions(1e-2));
      };
  std::ofstream norms(out + ".norms");
  auto train = [&](torch::nn::Sequential& model, ampx::dist::ZeroRedundancyOptimizer& opt,
                   ampx::GradScaler& scaler, int from, int to) {
    for (int step = from; step < to; ++step) {
      opt.zero_grad();
      scaler.scale(torch::mse_loss(model->forward(xs), ys)).backward();
      scaler.step(opt);
      scaler.update();
    }
  };
  auto scaler_options = ampx::GradScalerOptions().init_scale(1024.0).growth_interval(1000);

  auto model = make_model(100 + rank);
  ampx::dist::ZeroRedundancyOptimizer zero(weight_and_bias_groups(model), pg, factory, options);
  ampx::GradScaler scaler(scaler_options);
  std::vector<double> zero_norms;
  for (int step = 0; step < kSteps; ++step) {
    train(model, zero, scaler, step, step + 1);
    zero_norms.push_back(zero.last_grad_norm().value_or(-1.0));
  }
  write_params(model, out);

  auto ref = make_model(100 + rank);
  ampx::dist::DistributedDataParallel ddp(ref.ptr(), pg);
  ampx::optim::AdamW adamw(weight_and_bias_groups(ref),
                           ampx::optim::AdamWOptions(1e-2).max_grad_norm(kMaxNorm));
  ampx::GradScaler ref_scaler(scaler_options);
  for (int step = 0; step < kSteps; ++step) {
    adamw.zero_grad();
    ref_scaler.scale(torch::mse_loss(ref->forward(xs), ys)).backward();
    ddp.synchronize();
    double sum_sq = 0;
    for (const auto& p : ref->parameters()) sum_sq += p.grad().pow(2).sum().item<double>();
    norms << zero_norms[static_cast<size_t>(step)] << " " << std::sqrt(sum_sq) / 1024.0 << "\n";
    ref_scaler.step(adamw);
    ref_scaler.update();
  }
  write_params(ref, out + ".ref");

  auto first = make_model(100 + rank);
  std::stringstream saved;
  {
    ampx::dist::ZeroRedundancyOptimizer opt(weight_and_bias_groups(first), pg, factory, options);
    ampx::GradScaler s(scaler_options);
    train(first, opt, s, 0, kSteps / 2);
    torch::serialize::OutputArchive archive;
    opt.save(archive);
    archive.save_to(saved);
  }
  auto second = make_model(200 + rank);
  ampx::dist::ZeroRedundancyOptimizer opt(weight_and_bias_groups(second), pg, factory, options);
  {
    torch::NoGradGuard no_grad;
    auto to = second->parameters();
    auto from = first->parameters();
    for (size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
  }
  torch::serialize::InputArchive archive;
  archive.load_from(saved);
  opt.load(archive);
  ampx::GradScaler s(scaler_options);  // the scale never changed: 1024 throughout
  train(second, opt, s, kSteps / 2, kSteps);
  write_params(second, out + ".resumed");
  return 0;
}

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
  if (scenario == "zero-groups") return run_zero_groups(out, pg);
  if (scenario == "unused-order") return run_unused_order(out, pg);
  if (scenario.rfind("grads-", 0) == 0) return run_grads(scenario, out, pg);
  if (scenario == "fp16-sum") return run_fp16_sum(out, pg);
  if (scenario.rfind("zero", 0) == 0) return run_zero(scenario, out, pg);
  if (scenario.rfind("fp8", 0) == 0) return run_fp8(scenario, out, pg);
  if (scenario.rfind("plan-watch", 0) == 0) return dist_worker::run_plan_watch(scenario, out, pg);
  const int64_t rank = pg.rank(), world = pg.world_size();
  auto model = make_model(100 + rank);  // different on each rank: DDP broadcasts rank 0's
  ampx::dist::DistributedDataParallelOptions options;
  options.bucket_cap_bytes(512);  // several buckets for this small model
  if (scenario == "compressed") {
    // LibTorch 1.13's Gloo sums no bfloat16 (DDP says so); 2.x's does.
    const bool v1 = std::string(ampx::torch_version()).rfind("1.", 0) == 0;
    options.communication_dtype(v1 ? torch::kHalf : torch::kBFloat16);
  }
  if (scenario == "bf16-probe") options.communication_dtype(torch::kBFloat16);
  if (rank == world - 1) {
    if (scenario == "mismatch-shape") {  // 5 outputs instead of 4
      model = torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(),
                                    torch::nn::Linear(32, 16), torch::nn::Tanh(),
                                    torch::nn::Linear(16, 5));
    }
    if (scenario == "mismatch-count") model->push_back(torch::nn::Linear(4, 4));
    if (scenario == "mismatch-dtype") model->to(torch::kBFloat16);  // O2 on one rank only
    if (scenario == "mismatch-options") options.bucket_cap_bytes(1024);
  }
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
      // Two micro-batches: the first only accumulates, the second reduces.
      const int64_t half = xs.size(0) / 2;
      {
        auto guard = ddp.no_sync();
        (torch::mse_loss(model->forward(xs.slice(0, 0, half)), ys.slice(0, 0, half)) / 2)
            .backward();
      }
      (torch::mse_loss(model->forward(xs.slice(0, half)), ys.slice(0, half)) / 2).backward();
      ddp.synchronize();
      opt.step();
      continue;
    }
    auto loss = torch::mse_loss(model->forward(xs), ys);
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
  if (guard) {
    std::cout << "nonfinite " << guard->count() << std::endl;
    if (!guard->reports().empty()) {
      const auto& r = guard->reports().front();
      std::cout << "first " << r.op << " " << ampx::debug::to_string(r.direction) << " step "
                << r.step << (r.propagated() ? " propagated" : " created") << std::endl;
    }
  }
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
