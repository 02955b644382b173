#pragma once

// What multihost_test.cpp and multihost_faults_test.cpp share: MultiHostTest,
// which starts ranks of ampx-train (or another binary) on hosts simulated by
// network namespaces (simulated_hosts.h) with a launcher's variables, waits
// for them and collects what they said, and the readers of their output.

#include "run/checkpoint.h"
#include "simulated_hosts.h"
#include "test_support.h"

#include <ampx/dist.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <optional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#ifdef AMPX_TRAIN_BINARY

namespace multihost_test {

namespace fs = std::filesystem;
using ampx::train::test::contains;
using ampx::train::test::SimulatedHosts;

inline constexpr int kPort = 29500;  // every host is its own network: no other run can hold it

/// Whose variables the ranks get: torchrun's or Slurm's (srun).
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

/// The cores this process may run on.
inline int cores() {
  cpu_set_t set;
  return ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
}

/// Every regular file under `dir`.
inline std::vector<std::string> files_under(const fs::path& dir) {
  std::vector<std::string> out;
  if (!fs::exists(dir)) return out;
  for (const auto& f : fs::recursive_directory_iterator(dir)) {
    if (f.is_regular_file()) out.push_back(f.path().string());
  }
  return out;
}

/// "[O2] rank 2 of 4: weights 0x..." lines: the checksum of each rank's weights.
inline std::string weights_line(const std::string& output) {
  std::smatch m;
  static const std::regex re(R"(rank \d+ of \d+: weights (0x[0-9a-f]+))");
  return std::regex_search(output, m, re) ? m[1].str() : "";
}

/// The thread count a rank's placement line reports.
inline int threads_of(const std::string& output) {
  std::smatch m;
  static const std::regex re(R"(local rank \d+ of \d+, (\d+) threads?)");
  return std::regex_search(output, m, re) ? std::stoi(m[1].str()) : -1;
}

/// Starts ranks on simulated hosts as a launcher would, and collects what they said;
/// skips where hosts cannot be simulated or ampx has no c10d/Gloo.
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

  /// Every rank's output, each under a line naming it and its host.
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

  /// The losses the checkpoint at `checkpoint` recorded.
  std::vector<double> losses_in(const fs::path& checkpoint) {
    return ampx::train::read_checkpoint(checkpoint).meta.at("losses").get<std::vector<double>>();
  }

  ampx::train::test::TempDir tmp_{"ampx-multihost"};
  const fs::path dir_ = tmp_.path();
};

}  // namespace multihost_test

#endif  // AMPX_TRAIN_BINARY
