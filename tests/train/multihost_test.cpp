// ampx-train across hosts, on hosts simulated by network namespaces
// (simulated_hosts.h): each host has its own address on a bridge, its own
// working folder (a file one host writes is not on another), and reaches
// the others only over the network. Launched as torchrun and Slurm would:
// MASTER_ADDR is host 0's address, the ranks carry their host's index and
// local rank. Skipped where namespaces cannot be made (not root). Here the
// runs that train (gpt and mnist-cnn as one process, ZeRO-1, a resume spread
// differently); a misconfigured or lost host: multihost_faults_test.cpp.

#include "multihost_fixture.h"
#include "run/checkpoint.h"
#include "simulated_hosts.h"
#include "test_support.h"

#include <ampx/dist.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace multihost_test {
namespace {

#ifdef AMPX_TRAIN_BINARY

struct Layout {
  Launcher launcher;
  std::vector<int> per_host;
  std::string name;
};

void PrintTo(const Layout& layout, std::ostream* os) {
  *os << layout.name;
}

class MultiHostTrainTest : public MultiHostTest, public ::testing::WithParamInterface<Layout> {};

TEST_P(MultiHostTrainTest, GptO2TrainsAsOneProcessOnTheGlobalBatchWithRanksBitwiseEqual) {
  const Layout& layout = GetParam();
  const auto t0 = std::chrono::steady_clock::now();
  auto args = gpt_args(dir_ / "data");
  args.insert(args.end(), {"--steps", "3", "--precision", "O2", "--save-every", "3"});
  int world = 0;
  for (int n : layout.per_host) world += n;
  if (4 % world != 0) {  // three ranks: a global batch of 6 sequences
    *(std::find(args.begin(), args.end(), "--batch-size") + 1) = "6";
  }
  const auto one = run_single("one", args);
  ASSERT_EQ(one.status, 0) << one.out << one.err;

  SimulatedHosts hosts(static_cast<int>(layout.per_host.size()));
  auto ranks = start(hosts, "multi", layout.launcher, layout.per_host, args);
  finish(hosts, ranks);
  expect_ranks_agree(ranks);
  const auto l1 = losses_in(dir_ / "one" / "out" / "checkpoints" / "checkpoint.ampx");
  const auto lm = losses_in(dir_ / "multi" / "host0" / "out" / "checkpoints" / "checkpoint.ampx");
  ASSERT_EQ(l1.size(), 3u);
  ASSERT_EQ(lm.size(), 3u);
  // The tolerances of the single-host --nproc test (compare_test.cpp): the
  // same weights and batch at step 0 (1e-4 for two ranks of two sequences;
  // four ranks of one sequence round bf16's forward differently, 1e-3), then
  // bf16 rounding of the averaged gradients.
  EXPECT_NEAR(l1[0], lm[0], ranks.size() == 2 ? 1e-4 : 1e-3);
  for (size_t i = 1; i < 3; ++i) EXPECT_NEAR(l1[i], lm[i], 1e-2) << "step " << i;
  EXPECT_NE(lm, std::vector<double>(3, lm[0]));  // it trained
  // The network between the hosts changes nothing: the same ranks with the
  // same threads on one host (--nproc, loopback) give the same numbers, bitwise.
  auto same = args;
  const int threads = std::max(1, cores() / layout.per_host[0]);
  same.insert(same.end(),
              {"--nproc", std::to_string(ranks.size()), "--threads", std::to_string(threads)});
  const auto nproc = run_single("nproc", same);
  ASSERT_EQ(nproc.status, 0) << nproc.out << nproc.err;
  EXPECT_EQ(losses_in(dir_ / "nproc" / "out" / "checkpoints" / "checkpoint.ampx"), lm);

  // Threads: this host's cores over its processes of the run; where each
  // rank ran is what the launcher said.
  const std::string launcher_name = layout.launcher == Launcher::kTorchrun ? "torchrun" : "Slurm";
  for (size_t i = 0; i < ranks.size(); ++i) {
    const auto& r = ranks[i];
    const int local = layout.per_host[static_cast<size_t>(r.host)];
    EXPECT_EQ(threads_of(r.output), std::max(1, cores() / local)) << r.output;
    EXPECT_TRUE(
        contains(r.output, {"rank " + std::to_string(i) + " of " + std::to_string(ranks.size()) +
                                " (" + launcher_name + ")",
                            "(node " + std::to_string(r.host) + "), local rank " +
                                std::to_string(r.local_rank) + " of " + std::to_string(local),
                            "Gloo on " + hosts.address(r.host) + " (the route to MASTER_ADDR " +
                                hosts.address(0) + ")"}));
  }
  // Rank 0 alone wrote files: the other hosts' folders hold none.
  for (int h = 1; h < hosts.size(); ++h) {
    EXPECT_EQ(files_under(dir_ / "multi" / ("host" + std::to_string(h))),
              std::vector<std::string>{});
  }
  EXPECT_TRUE(fs::exists(dir_ / "multi" / "host0" / "out" / "metrics-O2.jsonl"));
  std::printf("[ measured ] %s: %.1f s\n", layout.name.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

INSTANTIATE_TEST_SUITE_P(Layouts, MultiHostTrainTest,
                         ::testing::Values(Layout{Launcher::kTorchrun, {1, 1}, "torchrun_2x1"},
                                           Layout{Launcher::kTorchrun, {2, 2}, "torchrun_2x2"},
                                           Layout{Launcher::kSlurm, {1, 1}, "slurm_2x1"},
                                           Layout{Launcher::kSlurm, {2, 2}, "slurm_2x2"},
                                           Layout{Launcher::kTorchrun, {1, 1, 1}, "torchrun_3x1"}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return info.param.name;
                         });

/// Synthetic MNIST in IDX files (the loader's format), `n` training and
/// `n / 4` test images of random pixels and labels.
void write_mnist(const fs::path& dir, int n) {
  std::mt19937 rng(5);
  auto be32 = [](std::string& out, uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<char>((v >> s) & 0xff));
  };
  for (const auto& [name, count] : {std::pair<std::string, int>{"train", n}, {"t10k", n / 4}}) {
    std::string images, labels;
    be32(images, 0x803);
    be32(images, static_cast<uint32_t>(count));
    be32(images, 28);
    be32(images, 28);
    for (int i = 0; i < count * 28 * 28; ++i) images.push_back(static_cast<char>(rng() & 0xff));
    be32(labels, 0x801);
    be32(labels, static_cast<uint32_t>(count));
    for (int i = 0; i < count; ++i) labels.push_back(static_cast<char>(rng() % 10));
    ampx::train::test::write_bytes(dir / "mnist" / (name + "-images-idx3-ubyte"), images);
    ampx::train::test::write_bytes(dir / "mnist" / (name + "-labels-idx1-ubyte"), labels);
  }
}

TEST_F(MultiHostTest, MnistCnnO2OnTwoHostsOfTwoTrainsBitwiseAsTheSameRanksOnOneHost) {
  // mnist-cnn normalizes with BatchNorm, whose statistics are each rank's
  // own (as with PyTorch's DDP without SyncBatchNorm): its reference is the
  // same four ranks on one host, which the network must not change.
  write_mnist(dir_ / "data", 256);
  const std::vector<std::string> args = {
      "--workload",   "mnist-cnn", "--data-dir",  (dir_ / "data").string(),
      "--out-dir",    "out",       "--steps",     "3",
      "--batch-size", "16",        "--precision", "O2",
      "--save-every", "3",         "--progress",  "none"};
  auto local = args;
  local.insert(local.end(),
               {"--nproc", "4", "--threads", std::to_string(std::max(1, cores() / 2))});
  const auto one = run_single("one", local);
  ASSERT_EQ(one.status, 0) << one.out << one.err;
  SimulatedHosts hosts(2);
  auto ranks = start(hosts, "multi", Launcher::kTorchrun, {2, 2}, args);
  finish(hosts, ranks);
  expect_ranks_agree(ranks);
  const auto l1 = losses_in(dir_ / "one" / "out" / "checkpoints" / "checkpoint.ampx");
  const auto lm = losses_in(dir_ / "multi" / "host0" / "out" / "checkpoints" / "checkpoint.ampx");
  ASSERT_EQ(lm.size(), 3u);
  EXPECT_EQ(l1, lm);
  EXPECT_NE(lm, std::vector<double>(3, lm[0]));  // it trained
  EXPECT_EQ(weights_line(one.out), weights_line(ranks[0].output));
  EXPECT_EQ(files_under(dir_ / "multi" / "host1"), std::vector<std::string>{});
}

#ifdef AMPX_DIST_WORKER
TEST_F(MultiHostTest, ZeroOneO2OnTwoHostsOfTwoEndsBitwiseAsOnOneHostAndResumes) {
  // dist_worker's zero-o2: ZeRO-1 with sharded fp32 masters of bf16 weights,
  // then the same with DDP (.ref), then ZeRO saved at step 10 and resumed
  // into fresh objects (.resumed). Once on one host of four ranks, once on
  // two hosts of two.
  auto params = [](const fs::path& p) { return ampx::train::test::read_bytes(p); };
  const std::vector<std::string> env = {"OMP_NUM_THREADS=1"};
  std::map<std::string, std::vector<std::string>> out;
  for (const auto& [name, layout] :
       {std::pair<std::string, std::vector<int>>{"one-host", {4}}, {"two-hosts", {2, 2}}}) {
    SimulatedHosts hosts(static_cast<int>(layout.size()));
    std::vector<Rank> ranks;
    int rank = 0;
    for (int h = 0; h < static_cast<int>(layout.size()); ++h) {
      for (int l = 0; l < layout[h]; ++l, ++rank) {
        const fs::path file = dir_ / name / ("rank" + std::to_string(rank) + ".params");
        Rank r;
        r.host = h;
        r.log = dir_ / name / ("rank" + std::to_string(rank) + ".log");
        auto e = launch_env(Launcher::kTorchrun, layout, h, l, rank, hosts.address(0));
        e.insert(e.end(), env.begin(), env.end());
        r.pid = hosts.start(h, e, {AMPX_DIST_WORKER, "zero-o2", file.string()}, r.log,
                            dir_ / name / ("host" + std::to_string(h)));
        ranks.push_back(std::move(r));
        out[name].push_back(file.string());
      }
    }
    finish(hosts, ranks);
    for (const auto& r : ranks) ASSERT_EQ(r.status, 0) << all_output(ranks);
  }
  const std::string zero = params(out["one-host"][0]);
  ASSERT_FALSE(zero.empty());
  for (int r = 0; r < 4; ++r) {
    const std::string& f = out["two-hosts"][static_cast<size_t>(r)];
    EXPECT_EQ(params(f), zero) << "rank " << r << ": ZeRO-1 across hosts differs";
    EXPECT_EQ(params(f + ".resumed"), zero) << "rank " << r << ": the resumed run differs";
    EXPECT_EQ(params(f + ".ref"), params(out["one-host"][0] + ".ref")) << "rank " << r << ": DDP";
  }
}
#endif  // AMPX_DIST_WORKER

TEST_F(MultiHostTest, CheckpointFromHost0ResumesARunSpreadDifferentlyBitwise) {
  auto args = gpt_args(dir_ / "data");
  args.insert(args.end(), {"--precision", "O2", "--threads", "1"});
  auto with = [&](std::vector<std::string> extra) {
    auto a = args;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  SimulatedHosts hosts(2);
  // Straight through, two hosts of two ranks.
  auto full = start(hosts, "full", Launcher::kTorchrun, {2, 2},
                    with({"--steps", "4", "--save-every", "4"}));
  finish(hosts, full);
  expect_ranks_agree(full);
  // Stopped after two steps...
  auto first = start(hosts, "split", Launcher::kTorchrun, {2, 2},
                     with({"--steps", "2", "--save-every", "2"}));
  finish(hosts, first);
  expect_ranks_agree(first);
  // ...and resumed as one rank on host 0 and three on host 1, which has no
  // checkpoint of its own: rank 0 reads it and sends it.
  auto second = start(hosts, "split", Launcher::kSlurm, {1, 3},
                      with({"--steps", "4", "--save-every", "2", "--resume"}));
  finish(hosts, second);
  expect_ranks_agree(second);
  EXPECT_EQ(weights_line(second[0].output), weights_line(full[0].output));
  const auto a = ampx::train::read_checkpoint(dir_ / "full/host0/out/checkpoints/checkpoint.ampx");
  const auto b = ampx::train::read_checkpoint(dir_ / "split/host0/out/checkpoints/checkpoint.ampx");
  EXPECT_EQ(a.meta.at("step"), 4);
  EXPECT_EQ(b.meta.at("step"), 4);
  EXPECT_EQ(a.meta.at("losses"), b.meta.at("losses"));
  EXPECT_TRUE(a.payload == b.payload) << "the resumed run's weights and optimizer state differ";
  EXPECT_EQ(files_under(dir_ / "split" / "host1"), std::vector<std::string>{});
  EXPECT_EQ(files_under(dir_ / "full" / "host1"), std::vector<std::string>{});
}

#endif  // AMPX_TRAIN_BINARY

}  // namespace
}  // namespace multihost_test
