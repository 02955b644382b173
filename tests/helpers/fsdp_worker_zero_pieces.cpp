// fsdp_worker's zero-pieces scenario (tests/dist/zero_pieces_test.cpp): a
// two-layer MLP whose first layer is fp32 and whose second keeps bf16
// weights (two flat spaces, gathered in 4 and 2 bytes an element) trains 6
// steps under ZeroRedundancyOptimizer with SGD, once with the default
// bucket_bytes (every space in one piece) and once with 24 bytes (pieces
// of a few elements a rank, crossing parameters and the padding), and in
// one process on every rank's batch. Writes <out>.whole, <out>.pieces and
// <out>.unsharded: every parameter's values ("param %a"), and "bytes
// <communicated>"; prints "refused bucket: <error>" for bucket_bytes 0.
// The pieces' masters are exported too (export_masters, below).

#include "fsdp_worker.h"

#include <ampx/dist.h>
#include <ampx/optim.h>
#include <ampx/safetensors.h>
#include <ampx/zero.h>

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_worker {
namespace {

/// The layers' parameters: fc1 in fp32, fc2 and an output gain in bf16
/// (used in fp32); and a buffer, which exports carry. The spaces (287 fp32
/// elements, 211 bf16) divide by neither 2 nor 3: both end in padding.
struct Mlp : torch::nn::Module {
  torch::Tensor w1, b1, w2, b2, gain;
  Mlp() {
    torch::manual_seed(11);
    w1 = register_parameter("w1", torch::randn({41, 6}) * 0.3);
    b1 = register_parameter("b1", torch::zeros({41}));
    w2 = register_parameter("w2", (torch::randn({5, 41}) * 0.2).to(torch::kBFloat16));
    b2 = register_parameter("b2", torch::zeros({5}, torch::kBFloat16));
    gain = register_parameter("gain", torch::ones({1}, torch::kBFloat16));
    register_buffer("seen", torch::arange(3, torch::kLong));
  }
  torch::Tensor forward(const torch::Tensor& x) const {
    const auto h = torch::tanh(torch::addmm(b1, x, w1.t()));
    return torch::addmm(b2.to(torch::kFloat), h, w2.to(torch::kFloat).t()) * gain.to(torch::kFloat);
  }
};

/// SGD with momentum: its update is linear in the gradients, so the
/// runs' different roundings of them stay as small in the weights.
ampx::optim::SGDOptions sgd_options() {
  return ampx::optim::SGDOptions(0.1).momentum(0.9);
}

/// Rank `rank`'s batch.
std::pair<torch::Tensor, torch::Tensor> batch(int64_t rank) {
  torch::manual_seed(5 + rank);
  const auto x = torch::randn({4, 6});
  return {x, torch::randn({4, 5})};
}

void write(const Mlp& mlp, const std::string& path, int64_t bytes) {
  std::ofstream out(path);
  for (const auto& p : mlp.parameters()) {
    const auto c = p.detach().to(torch::kFloat).contiguous();
    for (int64_t i = 0; i < c.numel(); ++i) out << "param " << hex(c.data_ptr<float>()[i]) << "\n";
  }
  out << "bytes " << bytes << "\n";
}

/// The same steps in one process, on every rank's batch (the mean of their
/// losses), with SGD's own fp32 masters of the bf16 layer.
void train_unsharded(int64_t world, const std::string& path) {
  Mlp mlp;
  ampx::optim::SGD opt(mlp.parameters(), sgd_options());
  for (int step = 0; step < 6; ++step) {
    opt.zero_grad();
    torch::Tensor loss = torch::zeros({});
    for (int64_t r = 0; r < world; ++r) {
      const auto [x, y] = batch(r);
      loss = loss + torch::mse_loss(mlp.forward(x), y) / static_cast<double>(world);
    }
    loss.backward();
    opt.step();
  }
  write(mlp, path, 0);
}

/// save_full_safetensors() of `opt`'s masters, in fp32 and bf16, to
/// <path>.streamed and <path>.streamed-bf16, beside rank 0's
/// save_safetensors() of gather_masters() to <path>.gathered(-bf16); and
/// one to a missing folder, refused on every rank ("refused export: ...").
void export_masters(ampx::dist::ProcessGroup& pg, const Mlp& mlp,
                    ampx::dist::ZeroRedundancyOptimizer& opt, const std::string& path) {
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  const auto masters = opt.gather_masters();  // every rank
  if (pg.rank() == 0) {
    std::map<std::string, torch::Tensor> fp32, bf16;
    size_t i = 0;
    for (const auto& p : mlp.named_parameters()) {
      fp32[p.key()] = masters.at(i);
      bf16[p.key()] = masters.at(i++).to(torch::kBFloat16);
    }
    for (const auto& b : mlp.named_buffers()) fp32[b.key()] = bf16[b.key()] = b.value();
    ampx::save_safetensors(fp32, path + ".gathered", metadata);
    ampx::save_safetensors(bf16, path + ".gathered-bf16", metadata);
  }
  opt.save_full_safetensors(path + ".streamed", mlp, metadata);
  opt.save_full_safetensors(path + ".streamed-bf16", mlp, metadata, torch::kBFloat16);
  try {
    const auto missing = std::filesystem::path(path).parent_path() / "missing" / "w.safetensors";
    opt.save_full_safetensors(missing.string(), mlp, metadata);
    std::cout << "accepted export" << std::endl;
  } catch (const c10::Error& e) {
    std::cout << "refused export: " << e.what_without_backtrace() << std::endl;
  }
}

void train(ampx::dist::ProcessGroup& pg, int64_t bucket_bytes, const std::string& path,
           bool exports = false) {
  Mlp mlp;
  ampx::dist::ZeroRedundancyOptimizer opt(
      mlp.parameters(), pg,
      [](std::vector<torch::Tensor> shard) {
        return std::make_unique<ampx::optim::SGD>(std::move(shard), sgd_options());
      },
      ampx::dist::ZeroRedundancyOptimizerOptions().bucket_bytes(bucket_bytes));
  const auto [x, y] = batch(pg.rank());
  for (int step = 0; step < 6; ++step) {
    opt.zero_grad();
    torch::mse_loss(mlp.forward(x), y).backward();
    opt.step();
  }
  write(mlp, path, opt.bytes_communicated());
  if (exports) export_masters(pg, mlp, opt, path);
}

}  // namespace

int run_zero_pieces(const std::string& out, ampx::dist::ProcessGroup& pg) {
  train(pg, ampx::dist::ZeroRedundancyOptimizerOptions().bucket_bytes(), out + ".whole");
  train(pg, 24, out + ".pieces", true);
  train_unsharded(pg.world_size(), out + ".unsharded");
  try {
    Mlp mlp;
    ampx::dist::ZeroRedundancyOptimizer opt(
        mlp.parameters(), pg,
        [](std::vector<torch::Tensor> shard) {
          return std::make_unique<ampx::optim::SGD>(std::move(shard), sgd_options());
        },
        ampx::dist::ZeroRedundancyOptimizerOptions().bucket_bytes(0));
    std::cout << "accepted bucket" << std::endl;
  } catch (const c10::Error& e) {
    std::cout << "refused bucket: " << e.what_without_backtrace() << std::endl;
  }
  return 0;
}

}  // namespace fsdp_worker
