// The ZeRO-1 scenarios of ampx_dist_worker (dist_worker.cpp starts them;
// tests/dist/zero_test.cpp and tests/train/multihost_test.cpp check them):
// ZeroRedundancyOptimizer against unsharded DistributedDataParallel with the
// same optimizer (zero, zero-o2, zero-groups), saved and resumed, and its
// loss scaler's found infs with and without the group (zero-overflow,
// zero-unsynced).

#include "dist_worker.h"

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <ampx/serialize.h>
#include <ampx/zero.h>

#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace dist_worker {
namespace {

using Factory = ampx::dist::ZeroRedundancyOptimizer::OptimizerFactory;
const ampx::optim::AdamWOptions kAdamW = ampx::optim::AdamWOptions(1e-2).weight_decay(0.01);
const Factory kAdamWFactory = [](std::vector<torch::Tensor> shard) {
  return std::make_unique<ampx::optim::AdamW>(std::move(shard), kAdamW);
};

/// Bytes of fp32 masters and moments an unsharded ampx optimizer holds.
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

/// zero-overflow and zero-unsynced: ZeRO-1 under a GradScaler whose loss is
/// inf on rank 1 at step 3, found infs synchronized over the group
/// (zero-overflow) or not; writes one "step scale stepped" line a step.
int run_zero_overflow(const std::string& scenario, const std::string& out,
                      ampx::dist::ProcessGroup& pg, torch::nn::Sequential model,
                      const torch::Tensor& xs, const torch::Tensor& ys) {
  ampx::dist::ZeroRedundancyOptimizer opt(model->parameters(), pg, kAdamWFactory);
  ampx::GradScaler scaler(ampx::GradScalerOptions().init_scale(1024.0).growth_interval(1000));
  if (scenario == "zero-overflow") ampx::dist::synchronize_found_inf(scaler, pg);
  std::ofstream log(out);
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    auto loss = torch::mse_loss(model->forward(xs), ys);
    if (pg.rank() == 1 && step == 3) loss = loss * INFINITY;
    scaler.scale(loss).backward();
    const bool stepped = static_cast<bool>(scaler.step(opt));
    scaler.update();
    log << step << " " << scaler.get_scale() << " " << stepped << "\n";
  }
  return 0;
}

/// Trains `model` with ZeRO-1's `opt` under `amp`, steps [from, to) on (xs, ys).
void train_zero(torch::nn::Sequential& model, ampx::AmpSession& amp,
                ampx::dist::ZeroRedundancyOptimizer& opt, const torch::Tensor& xs,
                const torch::Tensor& ys, int from, int to) {
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
}

/// Stops a ZeRO-1 run of `make(100 + rank)` after 10 steps, saves each rank's
/// shard, and resumes into fresh objects; writes the parameters to `out`.resumed.
/// Through files, as a user keeps them: ampx::save_archive, ampx::load_archive.
template <class Make>
void zero_save_and_resume(const Make& make, const ampx::AmpOptions& level, const std::string& out,
                          ampx::dist::ProcessGroup& pg, const torch::Tensor& xs,
                          const torch::Tensor& ys) {
  const int64_t rank = pg.rank();
  auto first = make(100 + rank);
  const std::string shard = out + ".shard";
  {
    ampx::dist::ZeroRedundancyOptimizer opt(first->parameters(), pg, kAdamWFactory);
    auto amp_first = ampx::initialize(first.ptr(), {}, level);
    train_zero(first, amp_first, opt, xs, ys, 0, kSteps / 2);
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
  train_zero(second, amp_resumed, opt, xs, ys, kSteps / 2, kSteps);
  write_params(second, out + ".resumed");
}

// zero-groups' clipping: the global gradient norm at most this.
constexpr double kMaxNorm = 0.05;

/// Two param groups of `model`: its weights (decay 0.1) and its biases (twice the lr, no decay).
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

}  // namespace

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
    return run_zero_overflow(scenario, out, pg, make(100 + rank), xs, ys);
  }

  // ZeRO-1: O2 casts the model after the optimizer has snapshot the fp32 weights.
  const auto level = ampx::AmpOptions(o2 ? ampx::OptLevel::O2 : ampx::OptLevel::O0);
  auto model = make(100 + rank);
  ampx::dist::ZeroRedundancyOptimizer zero(model->parameters(), pg, kAdamWFactory);
  auto amp_zero = ampx::initialize(model.ptr(), {}, level);
  train_zero(model, amp_zero, zero, xs, ys, 0, kSteps);
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
  zero_save_and_resume(make, level, out, pg, xs, ys);
  return 0;
}

// ZeRO-1 with two param groups (weights: decay; biases: twice the lr, no
// decay) and global gradient clipping, under a GradScaler, against DDP +
// ampx AdamW over the same groups clipping the whole gradient. Writes
// ZeRO's parameters to `out`, DDP's to `out`.ref, a run saved after 10 steps
// and resumed to `out`.resumed, and per step ZeRO's global norm and the norm
// of DDP's averaged gradients to `out`.norms.
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

}  // namespace dist_worker
