// Ranks that stall or were started wrong, on the real ampx-train binary
// with real processes: a rank stopped with SIGSTOP makes the others fail
// within --dist-timeout naming it (its sockets stay open and the kernel
// still accepts connections to it, so it must be told from a live one); a
// rank started with another world size, model shape or precision fails
// every rank at start-up naming the difference; a rendezvous port that
// another process holds is named. Each with 2 and 3 processes.

#include "distributed/rank_agreement.h"
#include "test_support.h"

#include <ampx/dist.h>

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace fs = std::filesystem;
using ampx::train::test::contains;

namespace {

TEST(RankAgreementTest, NamesEachDifferingFieldWithTheRanksOfEachValue) {
  const nlohmann::json a = {{"precision", "O2"}, {"d_model", 16}, {"seed", 5}};
  nlohmann::json b = a;
  b["d_model"] = 32;
  nlohmann::json c = a;
  c["precision"] = "O1";
  EXPECT_EQ(ampx::train::disagreement({a, a, a}), "");
  EXPECT_EQ(ampx::train::disagreement({a, b, a, c}),
            "d_model: 16 on rank(s) 0, 2, 3 vs 32 on rank(s) 1; "
            "precision: O2 on rank(s) 0, 1, 2 vs O1 on rank(s) 3");
}

#ifdef AMPX_TRAIN_BINARY

std::string host_name() {
  char name[256] = {0};
  return ::gethostname(name, sizeof(name) - 1) == 0 ? name : "?";
}

/// A rank started the way torchrun starts one: its variables in the
/// environment, its output in a log, a process group of its own.
struct RankProcess {
  pid_t pid = -1;
  fs::path log;
  std::optional<int> status;  // nullopt: still running at the deadline (then killed)
  double seconds = 0;         // from the start to its exit
  std::string output;
};

pid_t spawn_rank(const std::vector<std::string>& args, const std::vector<std::string>& env,
                 const fs::path& log) {
  return ampx::train::test::spawn_train(args, log, env);
}

/// Waits for every rank until `limit` after `start`; kills what still runs.
void wait_ranks(std::vector<RankProcess>& ranks, std::chrono::steady_clock::time_point start,
                std::chrono::seconds limit) {
  const auto deadline = start + limit;
  for (auto& r : ranks) {
    int status = 0;
    pid_t done = 0;
    while ((done = ::waitpid(r.pid, &status, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (done == r.pid) {
      r.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    } else {
      ::kill(-r.pid, SIGKILL);
      ::waitpid(r.pid, &status, 0);
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    r.output = ampx::train::test::read_bytes(r.log);
  }
}

/// Another program's server on a port of 127.0.0.1 while it lives: it
/// accepts every connection and closes it (it does not speak the store's
/// protocol).
class HeldPort {
 public:
  HeldPort() : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    TORCH_CHECK(fd_ >= 0 && ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
                    ::listen(fd_, 16) == 0 &&
                    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0 &&
                    ::pipe(wake_) == 0,
                "cannot hold a port");
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] {
      pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
      while (::poll(fds, 2, -1) >= 0 && fds[1].revents == 0) {
        if ((fds[0].revents & POLLIN) == 0) continue;
        const int c = ::accept(fd_, nullptr, nullptr);
        if (c >= 0) ::close(c);
      }
    });
  }
  ~HeldPort() {
    const char byte = 0;
    (void)!::write(wake_[1], &byte, 1);
    thread_.join();
    for (const int fd : {fd_, wake_[0], wake_[1]}) ::close(fd);
  }
  HeldPort(const HeldPort&) = delete;
  HeldPort& operator=(const HeldPort&) = delete;
  int port() const { return port_; }

 private:
  int fd_;
  int wake_[2] = {-1, -1};
  int port_ = 0;
  std::thread thread_;
};

class RankFaultsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!ampx::dist::is_available()) GTEST_SKIP() << "ampx built without c10d/Gloo";
    ampx::train::test::write_text_data(dir_.path() / "data", "abcdefgh ", 20000, 5);
  }

  /// A tiny gpt run in <tmp>/<name>.
  std::vector<std::string> args(const std::string& name, int64_t steps, double timeout_s,
                                const std::string& precision = "O2",
                                const std::string& d_model = "16") const {
    const auto out = dir_.path() / name;
    return ampx::train::test::tiny_gpt({{"--precision", precision},
                                        {"--data-dir", (dir_.path() / "data").string()},
                                        {"--out-dir", out.string()},
                                        {"--d-model", d_model},
                                        {"--batch-size", "12"},
                                        {"--steps", std::to_string(steps)},
                                        {"--seed", "5"},
                                        {"--dist-timeout", std::to_string(timeout_s)}});
  }

  /// torchrun's variables for rank `rank` of `world` on loopback.
  static std::vector<std::string> rank_env(int rank, int world, int port) {
    return {"RANK=" + std::to_string(rank),
            "WORLD_SIZE=" + std::to_string(world),
            "LOCAL_RANK=" + std::to_string(rank),
            "LOCAL_WORLD_SIZE=" + std::to_string(world),
            "MASTER_ADDR=127.0.0.1",
            "MASTER_PORT=" + std::to_string(port)};
  }

  ampx::train::test::TempDir dir_;
};

// --- a stopped rank -------------------------------------------------------

class StalledRankTest
    : public RankFaultsTest,
      public ::testing::WithParamInterface<std::tuple<int, int, std::string>> {};

TEST_P(StalledRankTest, OthersFailWithinTheTimeoutNamingTheStoppedRank) {
  const auto [nproc, stopped, shard] = GetParam();
  constexpr int kTimeoutS = 5;
  auto a = args("run", 1000000, kTimeoutS);
  a.insert(a.end(), {"--nproc", std::to_string(nproc), "--shard", shard});
  const fs::path log = dir_.path() / "run.log";
  const pid_t pid = ampx::train::test::spawn_train(a, log);
  const ampx::train::test::KillGroupGuard guard(pid);
  const fs::path metrics = dir_.path() / "run" / "metrics-O2.jsonl";
  ASSERT_TRUE(ampx::train::test::wait_for_lines(pid, metrics, 3))
      << ampx::train::test::wait_train(pid, log).output;
  const auto ranks = ampx::train::test::ranks_of(pid, nproc);
  ASSERT_NE(ranks[stopped], 0) << "rank " << stopped << " not found";
  ::kill(ranks[stopped], SIGSTOP);
  const auto since = std::chrono::steady_clock::now();
  const auto e = ampx::train::test::wait_train(pid, log, std::chrono::seconds(kTimeoutS + 60));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
  // (The launcher SIGKILLs the ranks when one fails; the guard kills and
  // continues what may be left.)
  std::printf("[ measured ] --nproc %d --shard %s, rank %d stopped: the run ended %.2f s later\n",
              nproc, shard.c_str(), stopped, s);
  EXPECT_FALSE(e.killed) << e.output;
  EXPECT_EQ(e.status, 1) << e.output;
  // The collective under way times out (the probe included) within the
  // timeout of its start; the margin is the exit on a loaded machine.
  EXPECT_LT(s, kTimeoutS + 4.0) << e.output;
  const std::string named = "not responding: rank " + std::to_string(stopped) +
                            " at 127.0.0.1 (host '" + host_name() +
                            "'): its host accepts the connection but the process did not reply";
  int failures = 0;
  std::istringstream lines(e.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("failed on rank") == std::string::npos) continue;
    ++failures;
    EXPECT_TRUE(contains(line, {"within the timeout of " + std::to_string(kTimeoutS * 1000) + " ms",
                                named, "stopped (SIGSTOP"}));
  }
  EXPECT_GE(failures, 1) << e.output;
  EXPECT_TRUE(contains(e.output, {"ended with status 1; stopping the others"}));
}

INSTANTIATE_TEST_SUITE_P(Ranks, StalledRankTest,
                         // --shard full: the units' all-gathers and reduce-scatters
                         ::testing::Values(std::make_tuple(2, 1, std::string("none")),
                                           std::make_tuple(3, 0, std::string("none")),
                                           std::make_tuple(2, 1, std::string("full"))),
                         [](const auto& info) {
                           return "nproc" + std::to_string(std::get<0>(info.param)) + "_stop" +
                                  std::to_string(std::get<1>(info.param)) + "_shard_" +
                                  std::get<2>(info.param);
                         });

// --- a rank started differently ------------------------------------------

class MisconfiguredRankTest : public RankFaultsTest,
                              public ::testing::WithParamInterface<std::tuple<int, std::string>> {};

TEST_P(MisconfiguredRankTest, EveryRankFailsAtStartUpNamingTheDifference) {
  const auto [nproc, what] = GetParam();
  constexpr int kTimeoutS = 60;  // the failure must come from the check, not the timeout
  const int odd = nproc - 1;     // the last rank is started differently
  const int port = ampx::dist::free_loopback_port();
  std::vector<RankProcess> ranks(static_cast<size_t>(nproc));
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < nproc; ++r) {
    const bool differs = r == odd;
    const int world = differs && what == "world_size" ? nproc + 1 : nproc;
    const auto a =
        args("run" + std::to_string(r), 3, kTimeoutS, differs && what == "precision" ? "O1" : "O2",
             differs && what == "model_shape" ? "32" : "16");
    auto& rank = ranks[static_cast<size_t>(r)];
    rank.log = dir_.path() / ("rank" + std::to_string(r) + ".log");
    rank.pid = spawn_rank(a, rank_env(r, world, port), rank.log);
  }
  wait_ranks(ranks, start, std::chrono::seconds(kTimeoutS + 30));
  std::string others;
  for (int r = 0; r < odd; ++r) others += (r == 0 ? "" : ", ") + std::to_string(r);
  const std::string n = std::to_string(nproc), m = std::to_string(nproc + 1);
  for (int r = 0; r < nproc; ++r) {
    const auto& rank = ranks[static_cast<size_t>(r)];
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_TRUE(rank.status.has_value()) << "still running after " << rank.seconds << " s\n"
                                         << rank.output;
    EXPECT_EQ(*rank.status, 1) << rank.output;
    EXPECT_LT(rank.seconds, kTimeoutS / 2) << rank.output;
    std::printf("[ measured ] rank %d of %d (%s differs) failed %.2f s after the start\n", r, nproc,
                what.c_str(), rank.seconds);
    if (what == "world_size") {
      EXPECT_TRUE(contains(
          rank.output, {"ranks were started with different world sizes",
                        "rank " + std::to_string(odd) + " (host '", "WORLD_SIZE=" + n,
                        "WORLD_SIZE=" + m, "Start every rank of a run with the same world size"}));
    } else if (what == "model_shape") {
      EXPECT_TRUE(
          contains(rank.output,
                   {"the ranks of this run were started with different settings",
                    "d_model: 16 on rank(s) " + others + " vs 32 on rank(s) " + std::to_string(odd),
                    "parameters: "}));
    } else {
      EXPECT_TRUE(contains(
          rank.output,
          {"the ranks of this run were started with different settings",
           "precision: O2 on rank(s) " + others + " vs O1 on rank(s) " + std::to_string(odd)}));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, MisconfiguredRankTest,
                         ::testing::Combine(::testing::Values(2, 3),
                                            ::testing::Values("world_size", "model_shape",
                                                              "precision")),
                         [](const auto& info) {
                           return "nproc" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param);
                         });

// --- a busy rendezvous port ----------------------------------------------

class BusyPortTest : public RankFaultsTest, public ::testing::WithParamInterface<int> {};

TEST_P(BusyPortTest, RankZeroNamesThePortAndTheOthersFailWithinTheTimeout) {
  const int nproc = GetParam();
  constexpr int kTimeoutS = 4;
  const HeldPort held;  // another program's server on MASTER_PORT
  const std::string p = std::to_string(held.port());
  std::vector<RankProcess> ranks(static_cast<size_t>(nproc));
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < nproc; ++r) {
    auto& rank = ranks[static_cast<size_t>(r)];
    rank.log = dir_.path() / ("rank" + std::to_string(r) + ".log");
    rank.pid = spawn_rank(args("run" + std::to_string(r), 3, kTimeoutS),
                          rank_env(r, nproc, held.port()), rank.log);
  }
  wait_ranks(ranks, start, std::chrono::seconds(kTimeoutS + 60));
  for (int r = 0; r < nproc; ++r) {
    const auto& rank = ranks[static_cast<size_t>(r)];
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_TRUE(rank.status.has_value()) << "still running after " << rank.seconds << " s\n"
                                         << rank.output;
    EXPECT_NE(*rank.status, 0) << rank.output;
    std::printf("[ measured ] rank %d of %d failed %.2f s after the start\n", r, nproc,
                rank.seconds);
    // Process start-up (a second or two here) comes before the timeout counts.
    EXPECT_LT(rank.seconds, kTimeoutS + 10.0) << rank.output;
  }
  EXPECT_TRUE(contains(ranks[0].output,
                       {"rank 0 cannot serve the rendezvous store on port " + p,
                        "(MASTER_PORT=" + p + "): another process listens on that port",
                        "Give every rank another MASTER_PORT", "ss -ltnp 'sport = :" + p + "'"}));
  for (int r = 1; r < nproc; ++r) {
    // What is on the port, found by connecting to it once more.
    EXPECT_TRUE(contains(ranks[static_cast<size_t>(r)].output,
                         {"ampx::dist: rank " + std::to_string(r) + " ",
                          "something at 127.0.0.1:" + p +
                              " accepts connections and closes them without a word, as no c10d "
                              "store does: another program holds MASTER_PORT=" +
                              p,
                          "give every rank another MASTER_PORT"}))
        << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, BusyPortTest, ::testing::Values(2, 3),
                         [](const auto& info) { return "nproc" + std::to_string(info.param); });

#endif  // AMPX_TRAIN_BINARY

}  // namespace
