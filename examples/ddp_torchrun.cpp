// Data-parallel training with ampx::dist, started as PyTorch users start
// theirs: one process per rank, by torchrun (docs/examples.md shows the
// Python script this ports, line for line):
//
//   torchrun --no-python --nproc-per-node 2 ./ddp_torchrun [--steps N]
//
// (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT:
// tests/helpers/run_ranks.sh starts two by hand). Every rank trains on its half of
// each global batch under autocast, with a GradScaler;
// DistributedDataParallel averages the gradients during backward. The
// program exits 1 unless every rank ends with rank 0's weights, bit for
// bit, and the global loss fell below a third of where it started.

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace {

torch::nn::Sequential make_model(int64_t in_size, int64_t out_size) {
  return torch::nn::Sequential(torch::nn::Linear(in_size, 128), torch::nn::ReLU(),
                               torch::nn::Linear(128, out_size));
}

// Global batch `step`: the same on every rank, a fixed function of the step.
std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t step, const torch::Tensor& teacher) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7000 + step);
  const auto x = torch::randn({64, teacher.size(0)}, gen);
  return {x, x.mm(teacher)};
}

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 60;
  if (argc == 3 && std::string(argv[1]) == "--steps") steps = std::atoll(argv[2]);
  if ((argc != 1 && argc != 3) || steps < 10) {
    std::fprintf(stderr, "usage: ddp_torchrun [--steps N>=10]\n");
    return 2;
  }
  if (!ampx::dist::is_available()) {
    std::fprintf(stderr, "ddp_torchrun: this ampx was built without c10d/Gloo\n");
    return 2;
  }
  auto pg = ampx::dist::init_process_group();  // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  const int64_t rank = pg.rank(), world = pg.world_size();
  at::set_num_threads(1);

  torch::manual_seed(0);
  const auto teacher = torch::randn({32, 8}) / std::sqrt(32.0);
  auto model = make_model(32, 8);
  ampx::dist::DistributedDataParallel ddp(model.ptr(), pg);  // rank 0's weights everywhere
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  ampx::GradScaler scaler;

  double first = 0, last = 0;
  for (int64_t step = 0; step < steps; ++step) {
    auto [x, y] = global_batch(step, teacher);
    x = x.chunk(world)[rank];
    y = y.chunk(world)[rank];
    torch::Tensor loss;
    {
      ampx::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      loss = torch::mse_loss(model->forward(x), y);
    }
    scaler.scale(loss).backward();  // the buckets all-reduce as their gradients are ready
    ddp.synchronize();              // wait, average into .grad
    scaler.step(opt);
    scaler.update();
    opt.zero_grad();
    auto global = loss.detach().reshape({1}).clone();
    pg.all_reduce_sum(global);
    const double mean = global.item<double>() / static_cast<double>(world);
    if (step < 5) first += mean / 5;
    if (step >= steps - 5) last += mean / 5;
  }

  // Every rank's weights against rank 0's, bit for bit.
  auto mine = torch::cat([&] {
    std::vector<torch::Tensor> flat;
    for (const auto& p : model->parameters()) flat.push_back(p.detach().reshape({-1}));
    return flat;
  }());
  auto all = torch::empty({world * mine.numel()}, mine.options());
  pg.all_gather(all, mine);
  bool same = true;
  for (int64_t r = 1; r < world; ++r) {
    same = same && torch::equal(all.slice(0, 0, mine.numel()),
                                all.slice(0, r * mine.numel(), (r + 1) * mine.numel()));
  }
  const bool learned = last < first / 3;
  if (rank == 0) {
    std::printf("%s: %lld ranks, %lld steps, global loss %.4f -> %.4f; weights %s on every rank\n",
                same && learned ? "ok" : "FAILED", static_cast<long long>(world),
                static_cast<long long>(steps), first, last, same ? "the same" : "DIFFERENT");
  }
  return same && learned ? 0 : 1;
}
