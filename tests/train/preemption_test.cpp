// Preemption of the real ampx-train binary: SIGTERM or SIGUSR1 (what Slurm
// and Kubernetes send before they kill a job) at random steps. Each time the
// run finishes its step, writes a checkpoint and exits with status 75; the
// chain of resumed runs ends with the same parameters, losses and scaler
// state, bit for bit, as a run never interrupted. Under --nproc, a signal
// that reaches one rank stops every rank after the same step.

#include "run/preemption.h"
#include "run/checkpoint.h"
#include "test_support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

namespace {

#ifdef AMPX_TRAIN_BINARY

using ampx::train::read_checkpoint;
using ampx::train::test::Exit;
using ampx::train::test::lines_in;
using ampx::train::test::losses_in_metrics;
using ampx::train::test::ranks_of;
using ampx::train::test::TempDir;
using ampx::train::test::wait_for_lines;

/// Every step's loss, the scaler's state and every parameter, bit for bit.
void expect_same_run(const fs::path& a_path, const fs::path& b_path) {
  const auto a = read_checkpoint(a_path);
  const auto b = read_checkpoint(b_path);
  EXPECT_EQ(a.meta.at("step"), b.meta.at("step"));
  EXPECT_EQ(a.meta.at("losses").get<std::vector<double>>(),
            b.meta.at("losses").get<std::vector<double>>());
  EXPECT_EQ(a.meta.at("amp"), b.meta.at("amp"));
  const auto pa = ampx::train::test::model_tensors(a_path);
  const auto pb = ampx::train::test::model_tensors(b_path);
  ASSERT_EQ(pa.size(), pb.size());
  ASSERT_FALSE(pa.empty());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].first, pb[i].first);
    EXPECT_TRUE(torch::equal(pa[i].second, pb[i].second)) << pa[i].first << " differs";
  }
}

/// Files left next to the checkpoint other than the checkpoint itself (a
/// temp file of an interrupted write would show here).
std::vector<std::string> strays_next_to(const fs::path& checkpoint) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(checkpoint.parent_path())) {
    if (e.path() != checkpoint) out.push_back(e.path().filename().string());
  }
  return out;
}

class PreemptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ampx::train::test::write_text_data(dir_.path() / "data", "abcdefgh ", 20000, 5);
  }

  /// A tiny gpt run writing into <tmp>/<name>, its checkpoint only at the
  /// end: every other one comes from a preemption. `mode`: a precision,
  /// then "/"-separated --masters (kahan, stochastic) or --optimizer-state
  /// (bf16, fp8, 8bit) values: "O3/kahan/8bit".
  std::vector<std::string> args(const std::string& name, const std::string& mode,
                                int64_t steps) const {
    const auto out = dir_.path() / name;
    std::vector<std::pair<std::string, std::string>> flags = {
        {"--precision", precision_of(mode)},
        {"--data-dir", (dir_.path() / "data").string()},
        {"--out-dir", out.string()},
        {"--checkpoint-dir", (out / "ck").string()},
        {"--steps", std::to_string(steps)},
        {"--seed", "5"},
        {"--save-every", "1000"}};
    std::istringstream parts(mode);
    std::string part;
    std::getline(parts, part, '/');  // the precision
    while (std::getline(parts, part, '/')) {
      const bool masters = part == "kahan" || part == "stochastic";
      flags.emplace_back(masters ? "--masters" : "--optimizer-state", part);
    }
    return ampx::train::test::tiny_gpt(flags);
  }
  static std::string precision_of(const std::string& mode) {
    return mode.substr(0, mode.find('/'));
  }
  fs::path checkpoint(const std::string& name) const {
    return dir_.path() / name / "ck" / "checkpoint.ampx";
  }
  fs::path metrics(const std::string& name, const std::string& mode) const {
    return dir_.path() / name / ("metrics-" + precision_of(mode) + ".jsonl");
  }

  TempDir dir_;
};

class PreemptionModeTest : public PreemptionTest,
                           public ::testing::WithParamInterface<std::string> {};

/// Signals per mode: 4 in `make test`, AMPX_PREEMPTION_SIGNALS in `make soak` (100).
int preemption_signals() {
  const char* v = std::getenv("AMPX_PREEMPTION_SIGNALS");
  return v && std::atoi(v) > 0 ? std::atoi(v) : 4;
}

TEST_P(PreemptionModeTest, SignalsAtRandomStepsEachCheckpointAndResumeBitwise) {
  const std::string mode = GetParam();
  const int kSignals = preemption_signals();
  // Room for every signal: each comes at most 4 steps after the last stop.
  const int64_t kSteps = 5 * kSignals + 10;
  const Exit ref =
      ampx::train::test::run_train(args("reference", mode, kSteps), dir_.path() / "reference.log");
  ASSERT_EQ(ref.status, 0) << ref.output;
  const auto ref_losses = read_checkpoint(checkpoint("reference")).meta.at("losses");

  // Random stop points (the seed printed, so that a failure can be replayed).
  const unsigned seed = std::random_device()();
  SCOPED_TRACE("random seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  int64_t done = 0;  // steps in the checkpoint
  for (int i = 0; i < kSignals; ++i) {
    const int signal = i % 2 == 0 ? SIGTERM : SIGUSR1;
    const int64_t after = done + 1 + static_cast<int64_t>(rng() % 4);  // metrics lines seen
    SCOPED_TRACE("signal " + std::to_string(i + 1) + ": " + ampx::train::signal_name(signal) +
                 " once step " + std::to_string(after) + " is in the metrics");
    auto a = args("run", mode, kSteps);
    if (i > 0) a.push_back("--resume");
    const fs::path log = dir_.path() / ("run-" + std::to_string(i) + ".log");
    const pid_t pid = ampx::train::test::spawn_train(a, log);
    ASSERT_TRUE(wait_for_lines(pid, metrics("run", mode), after))
        << ampx::train::test::wait_train(pid, log).output;
    ::kill(pid, signal);
    const Exit e = ampx::train::test::wait_train(pid, log);
    ASSERT_EQ(e.status, ampx::train::kExitPreempted) << e.output;

    // It finished the step it was in, wrote that step's metrics and checkpoint, and no more.
    const auto c = read_checkpoint(checkpoint("run"));
    const int64_t step = c.meta.at("step");
    EXPECT_GE(step, after);
    ASSERT_LT(step, kSteps) << "the signal came too late to test anything";
    EXPECT_EQ(lines_in(metrics("run", mode)), step);
    EXPECT_NE(e.output.find(ampx::train::signal_name(signal) + ": stopped after step " +
                            std::to_string(step)),
              std::string::npos)
        << e.output;
    EXPECT_NE(e.output.find("exit status 75 (preempted)"), std::string::npos) << e.output;
    EXPECT_EQ(strays_next_to(checkpoint("run")), std::vector<std::string>{});
    // The losses so far are the uninterrupted run's, bit for bit.
    const auto losses = c.meta.at("losses").get<std::vector<double>>();
    ASSERT_EQ(static_cast<int64_t>(losses.size()), step);
    EXPECT_EQ(losses, std::vector<double>(ref_losses.begin(), ref_losses.begin() + step));
    done = step;
    if (done + 5 >= kSteps) break;  // (never: kSteps has room for every signal)
  }

  auto a = args("run", mode, kSteps);
  a.push_back("--resume");
  const Exit last = ampx::train::test::run_train(a, dir_.path() / "last.log");
  ASSERT_EQ(last.status, 0) << last.output;
  expect_same_run(checkpoint("reference"), checkpoint("run"));
  EXPECT_EQ(losses_in_metrics(metrics("reference", mode)), losses_in_metrics(metrics("run", mode)));
}

// The modes, and the optimizer's other formats (issue 65): O2's fp32 masters
// with 8-bit moments, O3's Kahan-compensated bf16 weights with FP8 moments.
INSTANTIATE_TEST_SUITE_P(Modes, PreemptionModeTest,
                         ::testing::Values("fp32", "O1", "O2", "O3", "O2/8bit", "O3/kahan/fp8"));

/// The step each rank said it stopped after ("[O2] rank 1: SIGTERM: stopped after step 7").
std::vector<int64_t> stop_steps(const std::string& output, int nproc) {
  std::vector<int64_t> steps(nproc, -1);
  const std::regex line(R"(rank (\d+): [^\n]*: stopped after step (\d+))");
  for (std::sregex_iterator it(output.begin(), output.end(), line), end; it != end; ++it) {
    const int rank = std::stoi((*it)[1]);
    if (rank >= 0 && rank < nproc) steps[rank] = std::stoll((*it)[2]);
  }
  return steps;
}

TEST_F(PreemptionTest, NprocRanksStopAfterTheSameStepWhenOneRankOrTheLauncherIsSignalled) {
  constexpr int kProcs = 2;
  constexpr int64_t kSteps = 40;
  const std::string mode = "O2";
  auto with_ranks = [&](std::vector<std::string> a) {
    a.insert(a.end(), {"--nproc", std::to_string(kProcs)});
    return a;
  };
  const Exit ref = ampx::train::test::run_train(with_ranks(args("reference", mode, kSteps)),
                                                dir_.path() / "reference.log");
  ASSERT_EQ(ref.status, 0) << ref.output;

  // 1. SIGTERM to the last rank only: it alone knows, and all stop together.
  const fs::path log1 = dir_.path() / "run-1.log";
  const pid_t pid = ampx::train::test::spawn_train(with_ranks(args("run", mode, kSteps)), log1);
  ASSERT_TRUE(wait_for_lines(pid, metrics("run", mode), 5))
      << ampx::train::test::wait_train(pid, log1).output;
  const auto ranks = ranks_of(pid, kProcs);
  ASSERT_NE(ranks.back(), 0) << "rank " << kProcs - 1 << " not found";
  ::kill(ranks.back(), SIGTERM);
  const Exit e1 = ampx::train::test::wait_train(pid, log1, std::chrono::seconds(120));
  ASSERT_EQ(e1.status, ampx::train::kExitPreempted) << e1.output;
  const int64_t first = read_checkpoint(checkpoint("run")).meta.at("step");
  EXPECT_EQ(stop_steps(e1.output, kProcs), std::vector<int64_t>(kProcs, first)) << e1.output;
  EXPECT_NE(e1.output.find("rank 0: a preemption signal to another rank"), std::string::npos)
      << e1.output;
  EXPECT_EQ(lines_in(metrics("run", mode)), first);

  // 2. SIGUSR1 to the launching process, as Kubernetes does: it passes it on.
  const fs::path log2 = dir_.path() / "run-2.log";
  auto resume = with_ranks(args("run", mode, kSteps));
  resume.push_back("--resume");
  const pid_t pid2 = ampx::train::test::spawn_train(resume, log2);
  ASSERT_TRUE(wait_for_lines(pid2, metrics("run", mode), first + 3))
      << ampx::train::test::wait_train(pid2, log2).output;
  ::kill(pid2, SIGUSR1);
  const Exit e2 = ampx::train::test::wait_train(pid2, log2, std::chrono::seconds(120));
  ASSERT_EQ(e2.status, ampx::train::kExitPreempted) << e2.output;
  const int64_t second = read_checkpoint(checkpoint("run")).meta.at("step");
  ASSERT_LT(second, kSteps);
  EXPECT_GT(second, first);
  EXPECT_EQ(stop_steps(e2.output, kProcs), std::vector<int64_t>(kProcs, second)) << e2.output;

  // 3. To the end: the same run as the uninterrupted one.
  const Exit e3 = ampx::train::test::run_train(resume, dir_.path() / "run-3.log");
  ASSERT_EQ(e3.status, 0) << e3.output;
  expect_same_run(checkpoint("reference"), checkpoint("run"));
  EXPECT_EQ(losses_in_metrics(metrics("reference", mode)), losses_in_metrics(metrics("run", mode)));
}

TEST_F(PreemptionTest, CompareStopsAtThePreemptedModeWithItsStatus) {
  auto a = args("cmp", "O2", 400);
  const auto precision = std::find(a.begin(), a.end(), "--precision");
  *(precision + 1) = "fp32,O2";
  *precision = "--compare";
  const fs::path log = dir_.path() / "cmp.log";
  const pid_t pid = ampx::train::test::spawn_train(a, log);
  const fs::path fp32_metrics = dir_.path() / "cmp" / "metrics-fp32.jsonl";
  ASSERT_TRUE(wait_for_lines(pid, fp32_metrics, 3))
      << ampx::train::test::wait_train(pid, log).output;
  ::kill(pid, SIGTERM);
  const Exit e = ampx::train::test::wait_train(pid, log, std::chrono::seconds(120));
  EXPECT_EQ(e.status, ampx::train::kExitPreempted) << e.output;
  EXPECT_NE(e.output.find("fp32 was preempted; the comparison ends here"), std::string::npos)
      << e.output;
  const auto c = read_checkpoint(dir_.path() / "cmp" / "ck" / "fp32" / "checkpoint.ampx");
  EXPECT_EQ(c.meta.at("step").get<int64_t>(), lines_in(fp32_metrics));
  EXPECT_FALSE(fs::exists(dir_.path() / "cmp" / "metrics-O2.jsonl")) << "O2 started";
}

#endif  // AMPX_TRAIN_BINARY

}  // namespace
