// One rank of the data-parallel tests (tests/dist_test.cpp starts 2 or 3 of
// them on loopback with torchrun's variables: RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT).
//
//   ampx_dist_worker <scenario> <out-file>
//   scenarios: train | accumulate | compressed | overflow | kill
//
// The model is a small MLP; rank r starts from its own random weights
// (DistributedDataParallel must broadcast rank 0's) and trains on its shard
// of one global batch. Writes the final parameters (train, accumulate,
// compressed) or one "step scale stepped" line per step (overflow).

#include <ampx/ampx.h>
#include <ampx/dist.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

namespace {

constexpr int64_t kGlobalBatch = 12;
constexpr int kSteps = 20;

torch::nn::Sequential make_model(int64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 4));
}

void write_params(const torch::nn::Sequential& model, const std::string& path) {
  std::ofstream out(path, std::ios::binary);
  for (const auto& p : model->parameters()) {
    auto c = p.detach().contiguous();
    out.write(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
  }
}

int run(const std::string& scenario, const std::string& out) {
  ampx::dist::InitOptions init;
  init.timeout(std::chrono::seconds(scenario == "kill" ? 5 : 60));
  auto pg = ampx::dist::init_process_group(init);
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
  ampx::dist::DistributedDataParallel ddp(model.ptr(), pg, options);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  ampx::GradScaler scaler(ampx::GradScalerOptions().init_scale(1024.0).growth_interval(1000));

  torch::manual_seed(7);  // the same global batch on every rank
  const auto x = torch::randn({kGlobalBatch, 8}), y = torch::randn({kGlobalBatch, 4});
  const int64_t shard = kGlobalBatch / world;
  const auto xs = x.slice(0, rank * shard, (rank + 1) * shard);
  const auto ys = y.slice(0, rank * shard, (rank + 1) * shard);
  std::ofstream log(scenario == "overflow" ? out : "/dev/null");

  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    if (scenario == "kill" && rank == 1 && step == 2) std::_Exit(3);  // dies mid-training
    if (scenario == "accumulate") {
      // Two micro-batches: the first only accumulates, the second reduces.
      const int64_t half = shard / 2;
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
    scaler.scale(loss).backward();
    ddp.synchronize();
    const bool stepped = static_cast<bool>(scaler.step(opt));
    scaler.update();
    log << step << " " << scaler.get_scale() << " " << stepped << "\n";
  }
  if (scenario != "overflow") write_params(model, out);
  std::cout << "bytes " << ddp.bytes_communicated() << std::endl;
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
