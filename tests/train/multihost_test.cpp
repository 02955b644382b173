// ampx-train across hosts, on hosts simulated by network namespaces
// (simulated_hosts.h): each host has its own address on a bridge, its own
// working folder (a file one host writes is not on another), and reaches
// the others only over the network. Launched as torchrun and Slurm would:
// MASTER_ADDR is host 0's address, the ranks carry their host's index and
// local rank. Skipped where namespaces cannot be made (not root).

#include "run/checkpoint.h"
#include "simulated_hosts.h"
#include "test_support.h"

#include <ampx/dist.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sched.h>
#include <sys/stat.h>

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

namespace fs = std::filesystem;
using ampx::train::test::contains;
using ampx::train::test::SimulatedHosts;

namespace {

#ifdef AMPX_TRAIN_BINARY

constexpr int kPort = 29500;  // every host is its own network: no other run can hold it

enum class Launcher { kTorchrun, kSlurm };

/// A run's processes, where they ran and what they said.
struct Rank {
  int host = 0;
  int local_rank = 0;
  pid_t pid = -1;
  std::optional<int> status;  // nullopt: still running at the deadline
  fs::path log;
  std::string output;
};

int cores() {
  cpu_set_t set;
  return ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
}

/// Every regular file under `dir`.
std::vector<std::string> files_under(const fs::path& dir) {
  std::vector<std::string> out;
  if (!fs::exists(dir)) return out;
  for (const auto& f : fs::recursive_directory_iterator(dir)) {
    if (f.is_regular_file()) out.push_back(f.path().string());
  }
  return out;
}

/// "[O2] rank 2 of 4: weights 0x..." lines: the checksum of each rank's weights.
std::string weights_line(const std::string& output) {
  std::smatch m;
  static const std::regex re(R"(rank \d+ of \d+: weights (0x[0-9a-f]+))");
  return std::regex_search(output, m, re) ? m[1].str() : "";
}

/// The thread count a rank's placement line reports.
int threads_of(const std::string& output) {
  std::smatch m;
  static const std::regex re(R"(local rank \d+ of \d+, (\d+) threads?)");
  return std::regex_search(output, m, re) ? std::stoi(m[1].str()) : -1;
}

class MultiHostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!ampx::dist::is_available()) GTEST_SKIP() << "ampx built without c10d/Gloo";
    const std::string why = SimulatedHosts::unavailable_reason();
    if (!why.empty()) GTEST_SKIP() << "cannot simulate hosts: " << why;
    ampx::train::test::write_text_data(dir_ / "data", "abcdefgh ", 20000, 3);
  }

  /// The tiny gpt flags (as the single-host tests use), output relative to
  /// each host's own folder.
  static std::vector<std::string> gpt_args(const fs::path& data) {
    return ampx::train::test::tiny_gpt(
        {{"--data-dir", data.string()}, {"--out-dir", "out"}, {"--threads", ""}});
  }

  /// One process on this machine, outside any namespace: the reference.
  ampx::train::test::BinaryRun run_single(const std::string& name,
                                          const std::vector<std::string>& args) {
    const fs::path d = dir_ / name;
    fs::create_directories(d);
    std::vector<std::string> all = args;
    for (auto& a : all) {
      if (a == "out") a = (d / "out").string();
    }
    return ampx::train::test::run_binary_in(d, AMPX_TRAIN_BINARY, all);
  }

  /// The environment a launcher gives rank `rank` (host `host`, local rank
  /// `local`) of a run with `per_host` processes on each host.
  static std::vector<std::string> launch_env(Launcher launcher, const std::vector<int>& per_host,
                                             int host, int local, int rank,
                                             const std::string& master) {
    int world = 0;
    for (int n : per_host) world += n;
    std::vector<std::string> env = {
        // nothing of this test's own environment may speak for a launcher
        "RANK=",
        "WORLD_SIZE=",
        "LOCAL_RANK=",
        "LOCAL_WORLD_SIZE=",
        "GROUP_RANK=",
        "NODE_RANK=",
        "SLURM_PROCID=",
        "SLURM_NTASKS=",
        "SLURM_NODEID=",
        "SLURM_LOCALID=",
        "SLURM_TASKS_PER_NODE=",
        "SLURM_STEP_TASKS_PER_NODE=",
        "OMPI_COMM_WORLD_RANK=",
        "OMPI_COMM_WORLD_SIZE=",
        "GLOO_SOCKET_IFNAME=",
        "TORCHELASTIC_USE_AGENT_STORE=",
        "OMP_NUM_THREADS=",
        "MASTER_ADDR=" + master,
        "MASTER_PORT=" + std::to_string(kPort)};
    if (launcher == Launcher::kTorchrun) {
      env.insert(env.end(), {"RANK=" + std::to_string(rank), "WORLD_SIZE=" + std::to_string(world),
                             "LOCAL_RANK=" + std::to_string(local),
                             "LOCAL_WORLD_SIZE=" + std::to_string(per_host[host]),
                             "GROUP_RANK=" + std::to_string(host)});
    } else {
      // srun's own format: "2(x2)" for two nodes of two tasks, "1,3" otherwise.
      std::string tasks;
      const bool even =
          std::all_of(per_host.begin(), per_host.end(), [&](int n) { return n == per_host[0]; });
      if (even) {
        tasks = std::to_string(per_host[0]) + "(x" + std::to_string(per_host.size()) + ")";
      } else {
        for (int n : per_host) tasks += (tasks.empty() ? "" : ",") + std::to_string(n);
      }
      env.insert(env.end(),
                 {"SLURM_PROCID=" + std::to_string(rank), "SLURM_NTASKS=" + std::to_string(world),
                  "SLURM_NODEID=" + std::to_string(host), "SLURM_LOCALID=" + std::to_string(local),
                  "SLURM_TASKS_PER_NODE=" + tasks, "SLURM_STEP_TASKS_PER_NODE=" + tasks});
    }
    return env;
  }

  /// Starts `per_host[h]` ranks of `binary` on each host h of `hosts`, in
  /// <dir>/<name>/host<h>, with `args` (and `extra` environment on host
  /// `extra_host`, on all when -1), without waiting.
  std::vector<Rank> start(SimulatedHosts& hosts, const std::string& name, Launcher launcher,
                          const std::vector<int>& per_host, const std::vector<std::string>& args,
                          const std::string& master = "",
                          const std::vector<std::string>& extra = {}, int extra_host = -1,
                          const std::string& binary = AMPX_TRAIN_BINARY) {
    std::vector<Rank> ranks;
    int rank = 0;
    for (int h = 0; h < static_cast<int>(per_host.size()); ++h) {
      for (int l = 0; l < per_host[h]; ++l, ++rank) {
        Rank r;
        r.host = h;
        r.local_rank = l;
        r.log = dir_ / name / ("rank" + std::to_string(rank) + ".log");
        auto env =
            launch_env(launcher, per_host, h, l, rank, master.empty() ? hosts.address(0) : master);
        if (h == extra_host || extra_host < 0) env.insert(env.end(), extra.begin(), extra.end());
        std::vector<std::string> argv = {binary};
        argv.insert(argv.end(), args.begin(), args.end());
        r.pid = hosts.start(h, env, argv, r.log, dir_ / name / ("host" + std::to_string(h)));
        ranks.push_back(std::move(r));
      }
    }
    return ranks;
  }

  /// Waits for every rank (at most `limit`), collecting their output.
  static void finish(SimulatedHosts& hosts, std::vector<Rank>& ranks,
                     std::chrono::seconds limit = std::chrono::seconds(240)) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (auto& r : ranks) {
      if (!r.status) r.status = hosts.wait(r.pid, deadline);
      if (!r.status) hosts.kill(r.pid);
      r.output = ampx::train::test::read_bytes(r.log);
    }
  }

  static std::string all_output(const std::vector<Rank>& ranks) {
    std::string out;
    for (size_t i = 0; i < ranks.size(); ++i) {
      out += "== rank " + std::to_string(i) + " (host " + std::to_string(ranks[i].host) + ")\n" +
             ranks[i].output;
    }
    return out;
  }

  /// Every rank exited 0 and ended with the same weights, bitwise.
  static void expect_ranks_agree(const std::vector<Rank>& ranks) {
    const std::string first = weights_line(ranks[0].output);
    EXPECT_FALSE(first.empty()) << all_output(ranks);
    for (size_t i = 0; i < ranks.size(); ++i) {
      EXPECT_EQ(ranks[i].status, 0) << "rank " << i << "\n" << all_output(ranks);
      EXPECT_EQ(weights_line(ranks[i].output), first) << "rank " << i << "'s weights differ";
    }
  }

  std::vector<double> losses_in(const fs::path& checkpoint) {
    return ampx::train::read_checkpoint(checkpoint).meta.at("losses").get<std::vector<double>>();
  }

  ampx::train::test::TempDir tmp_{"ampx-multihost"};
  const fs::path dir_ = tmp_.path();
};

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

TEST_F(MultiHostTest, LoopbackMasterAddrOnHost0FailsNamingGlooSocketIfnameAndWorksWithIt) {
  // Debian's /etc/hosts maps a machine's own name to 127.0.1.1: on host 0
  // "node0" is loopback, on host 1 it is host 0's address. The store (rank
  // 0 serves it on every interface) is reached; Gloo, bound where the route
  // to MASTER_ADDR leads on host 0, would be loopback, which host 1 cannot
  // reach.
  SimulatedHosts hosts(2);
  hosts.set_hosts_file(0, "127.0.0.1 localhost\n127.0.1.1 node0\n");
  hosts.set_hosts_file(1, "127.0.0.1 localhost\n" + hosts.address(0) + " node0\n");
  auto args = gpt_args(dir_ / "data");
  args.insert(args.end(), {"--steps", "2", "--precision", "O2", "--dist-timeout", "30"});
  const auto t0 = std::chrono::steady_clock::now();
  auto failed = start(hosts, "plain", Launcher::kTorchrun, {1, 1}, args, "node0");
  finish(hosts, failed, std::chrono::seconds(60));
  const double fail_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const auto& r : failed) {
    EXPECT_EQ(r.status, 1) << all_output(failed);
    EXPECT_TRUE(contains(
        r.output,
        {"rank 0 on host", "would serve Gloo on 127.0.0.1", "the route to MASTER_ADDR node0",
         "rank(s) 1 (" + hosts.address(1) + ") on other hosts cannot reach",
         "Set GLOO_SOCKET_IFNAME", "eth0 " + hosts.address(0)}));
  }
  EXPECT_LT(fail_s, 30) << "the ranks must fail at the rendezvous, not wait for Gloo's timeout";

  // An interface that host 0 does not have is named as such.
  // (rank 1 then waits for rank 0 at the rendezvous, and says so, after a
  // shorter timeout).
  auto short_args = gpt_args(dir_ / "data");
  short_args.insert(short_args.end(), {"--steps", "2", "--dist-timeout", "4"});
  auto wrong = start(hosts, "wrong", Launcher::kTorchrun, {1, 1}, short_args, "node0",
                     {"GLOO_SOCKET_IFNAME=eth9"}, 0);
  finish(hosts, wrong, std::chrono::seconds(60));
  EXPECT_EQ(wrong[0].status, 1);
  EXPECT_TRUE(contains(wrong[0].output,
                       {"GLOO_SOCKET_IFNAME=eth9: host", "has no interface 'eth9'", "eth0"}));
  EXPECT_EQ(wrong[1].status, 1);
  // Rank 1 never reached rank 0's store ("could not reach"), or reached it
  // just before rank 0 ended, while joining ("cannot use", the store's
  // connection reset) or while waiting ("lost the rendezvous store"), as a
  // loaded machine orders them: each names the rendezvous at node0.
  EXPECT_TRUE(contains(wrong[1].output, {"rank 1", "reach the rendezvous at", "node0"}) ||
              contains(wrong[1].output, {"rank 1", "cannot use the rendezvous at", "node0"}) ||
              contains(wrong[1].output, {"rank 1", "lost the rendezvous store at", "node0"}))
      << wrong[1].output;

  // The documented setting on host 0: the same launch trains.
  auto fixed = start(hosts, "fixed", Launcher::kTorchrun, {1, 1}, args, "node0",
                     {"GLOO_SOCKET_IFNAME=eth0"}, 0);
  finish(hosts, fixed);
  expect_ranks_agree(fixed);
  EXPECT_TRUE(
      contains(fixed[0].output, {"Gloo on " + hosts.address(0) + " (GLOO_SOCKET_IFNAME=eth0)"}));
  EXPECT_TRUE(contains(fixed[1].output,
                       {"Gloo on " + hosts.address(1) + " (the route to MASTER_ADDR node0)"}));
  std::printf("[ measured ] loopback failure after %.1f s\n", fail_s);
}

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

class LostHostTest : public MultiHostTest {
 protected:
  static constexpr int kTimeoutS = 8;

  /// Starts a long run of two hosts of two ranks with a checkpoint every 2
  /// steps and returns once the first is written.
  std::vector<Rank> start_long_run(SimulatedHosts& hosts, const std::string& name) {
    auto args = gpt_args(dir_ / "data");
    args.insert(args.end(), {"--steps", "1000000", "--precision", "O2", "--save-every", "2",
                             "--dist-timeout", std::to_string(kTimeoutS)});
    auto ranks = start(hosts, name, Launcher::kTorchrun, {2, 2}, args);
    const fs::path ckpt = checkpoint(name);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (!fs::exists(ckpt) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // a few more steps
    return ranks;
  }

  fs::path checkpoint(const std::string& name) const {
    return dir_ / name / "host0" / "out" / "checkpoints" / "checkpoint.ampx";
  }

  /// Host 0's ranks: failed, their error written within the timeout of
  /// `since` (the log's last write: the error is a rank's last words; the
  /// process's exit comes a moment later, longer on a loaded machine),
  /// naming host 1's ranks.
  void expect_host0_fails_naming_host1(SimulatedHosts& hosts, std::vector<Rank>& ranks,
                                       std::chrono::system_clock::time_point since,
                                       const std::string& why, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kTimeoutS + 30);
    for (int r = 0; r < 2; ++r) {
      auto& rank = ranks[static_cast<size_t>(r)];
      rank.status = hosts.wait(rank.pid, deadline);
      rank.output = ampx::train::test::read_bytes(rank.log);
      ASSERT_TRUE(rank.status.has_value()) << "rank " << r << " still runs after " << what << "\n"
                                           << rank.output;
      EXPECT_EQ(*rank.status, 1) << rank.output;
      struct stat st {};
      ASSERT_EQ(::stat(rank.log.c_str(), &st), 0);
      const auto written = std::chrono::system_clock::time_point(
          std::chrono::duration_cast<std::chrono::system_clock::duration>(
              std::chrono::seconds(st.st_mtim.tv_sec) +
              std::chrono::nanoseconds(st.st_mtim.tv_nsec)));
      const double s = std::chrono::duration<double>(written - since).count();
      // Within the timeout: the probe naming the peers comes out of it (a
      // collective already under way when the link went down ends sooner).
      EXPECT_LT(s, kTimeoutS + 0.25) << "rank " << r << " failed " << s << " s after " << what;
      // (Ranks that failed first and exited may be named too: they are gone by then.)
      EXPECT_TRUE(contains(rank.output,
                           {"failed on rank " + std::to_string(r) + " of 4",
                            "within the timeout of " + std::to_string(kTimeoutS * 1000) + " ms",
                            "unreachable peer(s): ", "rank 2 at " + hosts.address(1) + " (host '",
                            "rank 3 at " + hosts.address(1) + " (host '", why}))
          << "rank " << r;
      std::printf("[ measured ] rank %d failed %.2f s after %s\n", r, s, what);
    }
  }
};

TEST_F(LostHostTest, AHostWhoseLinkGoesDownFailsTheOthersWithinTheTimeoutNamingItsRanks) {
  SimulatedHosts hosts(2);
  auto ranks = start_long_run(hosts, "cut");
  ASSERT_TRUE(fs::exists(checkpoint("cut"))) << all_output(ranks);
  const auto since = std::chrono::system_clock::now();
  hosts.cut(1);
  expect_host0_fails_naming_host1(
      hosts, ranks, since, "its host is down or the network to it is cut", "the link went down");
  // The last checkpoint is whole and loads.
  const auto c = ampx::train::read_checkpoint(checkpoint("cut"));
  EXPECT_GE(c.meta.at("step").get<int64_t>(), 2);
  EXPECT_EQ(c.meta.at("step").get<int64_t>() % 2, 0);
}

TEST_F(LostHostTest, KilledProcessesOnOneHostFailTheOthersNamingThem) {
  SimulatedHosts hosts(2);
  auto ranks = start_long_run(hosts, "kill");
  ASSERT_TRUE(fs::exists(checkpoint("kill"))) << all_output(ranks);
  const auto since = std::chrono::system_clock::now();
  hosts.kill({ranks[2].pid, ranks[3].pid});
  expect_host0_fails_naming_host1(hosts, ranks, since, "connection refused, its process is gone",
                                  "host 1's processes were killed");
  const auto c = ampx::train::read_checkpoint(checkpoint("kill"));
  EXPECT_GE(c.meta.at("step").get<int64_t>(), 2);
}

#endif  // AMPX_TRAIN_BINARY

}  // namespace
