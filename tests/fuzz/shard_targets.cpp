// The fuzz targets of sharded checkpoints (tests/fuzz/README.md):
// FullyShardedDataParallel::load_shards of an archive a C++ user reads with
// ampx::load_archive (fsdp_shard), and of ampx-train's shard file, its
// CRC-32 recomputed after each mutation (train_shard). Beyond the driver's
// findings, each checks the promise of load_shards: a refused shard changes
// nothing (the pieces, the buffers, the optimizer's moments and step
// counts), and an accepted one saves and loads back to the same state.

#include "targets.h"

#include "distributed/shard_checkpoint.h"
#include "run/checkpoint.h"

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <ampx/fsdp.h>
#include <ampx/serialize.h>

#include <torch/serialize.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <vector>

namespace ampx::fuzz {
namespace {

/// A Linear(4, 3) unit under the root's BatchNorm1d(3): parameters in two
/// units, and buffers of two dtypes (the running statistics, the int64 count).
struct ShardedNetImpl : torch::nn::Module {
  ShardedNetImpl()
      : fc(register_module("fc", torch::nn::Linear(4, 3))),
        bn(register_module("bn", torch::nn::BatchNorm1d(3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return bn(ampx::dist::sharded_forward(fc, x)); }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
};
TORCH_MODULE(ShardedNet);

/// The sharded model and its AdamW on a group of one rank: one per process
/// (each fuzzed input runs in a child of its own).
struct Sharded {
  ShardedNet net;
  std::unique_ptr<ampx::dist::FullyShardedDataParallel> fsdp;
  std::unique_ptr<ampx::optim::AdamW> opt;

  explicit Sharded(const char* store) {
    torch::manual_seed(0);
    ampx::dist::LaunchEnv env;
    env.master_addr = "127.0.0.1";
    auto group = ampx::dist::init_process_group(
        env, ampx::dist::InitOptions().store_file(
                 scratch_file(("store-" + std::to_string(::getpid()) + "-" + store).c_str())));
    fsdp = std::make_unique<ampx::dist::FullyShardedDataParallel>(
        net.ptr(), group, std::vector<std::shared_ptr<torch::nn::Module>>{net->fc.ptr()});
    opt = std::make_unique<ampx::optim::AdamW>(fsdp->parameters(), ampx::optim::AdamWOptions(1e-2));
  }

  /// One training step: the optimizer gets its moments, the norm its statistics.
  void step() {
    opt->zero_grad();
    ampx::dist::sharded_forward(net, torch::randn({5, 4})).square().sum().backward();
    opt->step();
  }

  /// Everything load_shards may change, copied.
  std::vector<torch::Tensor> state() const {
    std::vector<torch::Tensor> all;
    for (const auto& p : fsdp->parameters()) {
      all.push_back(p.detach().clone());
      for (const auto& t : {opt->exp_avg(p), opt->exp_avg_sq(p)}) {
        all.push_back(t.defined() ? t.clone() : torch::Tensor());
      }
      all.push_back(torch::tensor(opt->step_count(p)));
    }
    for (const auto& b : net->buffers()) all.push_back(b.clone());
    return all;
  }
};

/// The process's Sharded. A child forked after its parent made one (the
/// driver runs the seeds in the parent, then each input in a child) makes
/// its own: the parent's Gloo threads did not fork with it, and its
/// collectives would wait for them. The inherited one is kept, not freed.
Sharded& sharded() {
  static pid_t owner = 0;
  static std::vector<std::unique_ptr<Sharded>> made;
  if (owner != ::getpid()) {
    made.push_back(std::make_unique<Sharded>("shard-target"));
    owner = ::getpid();
  }
  return *made.back();
}

bool same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined()) return false;
    if (!a[i].defined()) continue;
    if (a[i].scalar_type() != b[i].scalar_type() || a[i].sizes() != b[i].sizes()) return false;
    if (std::memcmp(a[i].data_ptr(), b[i].data_ptr(), a[i].nbytes()) != 0) return false;
  }
  return true;
}

/// load_shards(1, read) on the target's model: a refusal must change
/// nothing; what it accepts must save and load back to the same state.
void load_checked(const ampx::dist::FullyShardedDataParallel::ShardReader& read) {
  Sharded& s = sharded();
  const auto before = s.state();
  try {
    s.fsdp->load_shards(1, read, s.opt.get());
  } catch (const std::exception&) {
    if (!same(before, s.state())) {
      std::fprintf(stderr,
                   "fuzz: load_shards refused a shard but changed the model or optimizer\n");
      std::abort();
    }
    throw;
  }
  const auto loaded = s.state();
  torch::serialize::OutputArchive out;
  s.fsdp->save_shard(out, s.opt.get());
  std::ostringstream bytes;
  out.save_to(bytes);
  s.fsdp->load_shards(
      1,
      [&](int64_t, torch::serialize::InputArchive& in) {
        std::istringstream again(bytes.str());
        in.load_from(again);
      },
      s.opt.get());
  if (!same(loaded, s.state())) {
    std::fprintf(stderr, "fuzz: a loaded shard saved and loaded again differs\n");
    std::abort();
  }
}

const nlohmann::json kRun = {{"workload", "gpt"}, {"shard", "full"}};
constexpr int64_t kStep = 3;

}  // namespace

void fsdp_shard(const uint8_t* data, size_t size) {
  const std::string path = scratch_file("fsdp-shard.pt");
  write_file(path, data, size);
  load_checked(
      [&](int64_t, torch::serialize::InputArchive& archive) { ampx::load_archive(archive, path); });
}

void train_shard(const uint8_t* data, size_t size) {
  const auto bytes = with_valid_crc(data, size);
  const std::string path = scratch_file("checkpoint-step3-rank0-of1.ampx");
  write_file(path, bytes.data(), bytes.size());
  load_checked([&](int64_t rank, torch::serialize::InputArchive& archive) {
    ampx::train::read_shard_file(path, rank, 1, kStep, kRun, archive);
  });
}

std::vector<Seed> shard_seeds() {
  Sharded s("shard-seeds");
  s.step();
  s.step();
  torch::serialize::OutputArchive archive;
  s.fsdp->save_shard(archive, s.opt.get());
  const std::string path = scratch_file("seed-fsdp-shard.pt");
  ampx::save_archive(archive, path);
  std::ostringstream payload;
  archive.save_to(payload);
  const std::string file = scratch_file("seed-train-shard.ampx");
  ampx::train::write_checkpoint(file,
                                {{"format", "ampx-train shard"},
                                 {"run", kRun},
                                 {"step", kStep},
                                 {"rank", 0},
                                 {"world_size", 1}},
                                payload.str());
  return {{"fsdp_shard", "seed-1.pt", read_whole(path)},
          {"train_shard", "seed-1.ampx", read_whole(file)}};
}

}  // namespace ampx::fuzz
