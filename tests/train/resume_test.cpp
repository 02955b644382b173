// Kill-and-resume of the real ampx-train binary: a run SIGKILLed at a random
// step and resumed from its last checkpoint ends with the same parameters
// and the same per-step losses, bit for bit, as a run never interrupted. And
// damaged or foreign checkpoints are refused, never overwritten.

#include "run/checkpoint.h"
#include "test_support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

namespace {

#ifdef AMPX_TRAIN_BINARY

using ampx::train::test::Exit;
using ampx::train::test::lines_in;
using ampx::train::test::losses_in_metrics;
using ampx::train::test::read_bytes;
using ampx::train::test::TempDir;
using ampx::train::test::write_bytes;

pid_t spawn(const std::vector<std::string>& args, const fs::path& log) {
  return ampx::train::test::spawn_train(args, log);
}
Exit wait_for(pid_t pid, const fs::path& log) {
  return ampx::train::test::wait_train(pid, log);
}
Exit run(const std::vector<std::string>& args, const fs::path& log) {
  return ampx::train::test::run_train(args, log);
}

/// A text of seeded random words: enough for a tiny GPT to learn something.
void write_text(const fs::path& data_dir) {
  std::mt19937 rng(7);
  const std::vector<std::string> words = {"the", "whale",   "sea",   "ship",    "call",
                                          "me",  "ishmael", "white", "captain", "harpoon"};
  std::string text;
  while (text.size() < 30000) text += words[rng() % words.size()] + (rng() % 9 ? " " : ".\n");
  write_bytes(data_dir / "moby-dick" / "data.txt", text);
}

class ResumeTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { write_text(dir_.path() / "data"); }

  /// A tiny gpt run of mode GetParam() writing into <tmp>/<name>.
  std::vector<std::string> args(const std::string& name, int64_t steps,
                                const std::string& precision = "",
                                const std::string& d_model = "32") const {
    const auto out = dir_.path() / name;
    return ampx::train::test::tiny_gpt({{"--precision", precision.empty() ? GetParam() : precision},
                                        {"--data-dir", (dir_.path() / "data").string()},
                                        {"--out-dir", out.string()},
                                        {"--checkpoint-dir", (out / "ck").string()},
                                        {"--layers", "2"},
                                        {"--d-model", d_model},
                                        {"--block-size", "16"},
                                        {"--steps", std::to_string(steps)},
                                        {"--seed", "11"}});
  }
  fs::path checkpoint(const std::string& name) const {
    return dir_.path() / name / "ck" / "checkpoint.ampx";
  }
  fs::path metrics(const std::string& name) const {
    return dir_.path() / name / ("metrics-" + GetParam() + ".jsonl");
  }

  TempDir dir_;
};

using ampx::train::test::model_tensors;

TEST_P(ResumeTest, SigkillAtRandomStepThenResumeIsBitwiseIdenticalToUninterrupted) {
  // One path for the 16-bit CPU products in every process (auto times them
  // in each; on a loaded machine two processes may take two paths).
  ampx::train::test::EnvGuard products("AMPX_CPU_PRODUCTS", "native");
  constexpr int64_t kSteps = 60;
  auto ref_args = args("reference", kSteps);
  ref_args.insert(ref_args.end(), {"--save-every", "1000"});  // final checkpoint only
  const Exit ref = run(ref_args, dir_.path() / "reference.log");
  ASSERT_EQ(ref.status, 0) << ref.output;

  // Kill at a random step (printed, so a failure can be replayed).
  std::random_device device;
  const int64_t kill_after = 5 + static_cast<int64_t>(device() % 40);
  SCOPED_TRACE("SIGKILL after step " + std::to_string(kill_after));
  auto run_args = args("interrupted", kSteps);
  run_args.insert(run_args.end(), {"--save-every", "1"});
  const pid_t pid = spawn(run_args, dir_.path() / "interrupted.log");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (lines_in(metrics("interrupted")) < kill_after &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ::kill(pid, SIGKILL);
  const Exit killed = wait_for(pid, dir_.path() / "interrupted.log");
  ASSERT_TRUE(killed.killed) << "the run ended before it could be killed:\n" << killed.output;
  const int64_t done = ampx::train::read_checkpoint(checkpoint("interrupted")).meta.at("step");
  ASSERT_LT(done, kSteps);

  auto resume_args = run_args;
  resume_args.push_back("--resume");
  const Exit resumed = run(resume_args, dir_.path() / "resumed.log");
  ASSERT_EQ(resumed.status, 0) << resumed.output;

  const auto a = ampx::train::read_checkpoint(checkpoint("reference"));
  const auto b = ampx::train::read_checkpoint(checkpoint("interrupted"));
  EXPECT_EQ(a.meta.at("step"), kSteps);
  EXPECT_EQ(b.meta.at("step"), kSteps);
  // Every step's loss, bit for bit (JSON doubles round-trip exactly).
  EXPECT_EQ(a.meta.at("losses").get<std::vector<double>>(),
            b.meta.at("losses").get<std::vector<double>>());
  EXPECT_EQ(a.meta.at("amp"), b.meta.at("amp"));
  // The metrics file of the resumed run holds each step once, same losses.
  EXPECT_EQ(losses_in_metrics(metrics("reference")), losses_in_metrics(metrics("interrupted")));

  const auto pa = model_tensors(checkpoint("reference"));
  const auto pb = model_tensors(checkpoint("interrupted"));
  ASSERT_EQ(pa.size(), pb.size());
  ASSERT_GT(pa.size(), 10u);
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].first, pb[i].first);
    EXPECT_EQ(pa[i].second.dtype(), pb[i].second.dtype()) << pa[i].first;
    EXPECT_TRUE(torch::equal(pa[i].second, pb[i].second)) << pa[i].first << " differs";
  }
  // And training did something: the weights moved and the loss fell.
  const auto losses = a.meta.at("losses").get<std::vector<double>>();
  EXPECT_LT(losses.back(), losses.front() - 0.5);
}

// fp8: the FP8 layers' amax histories and scales are model buffers, so the
// tensor comparison above covers them too.
INSTANTIATE_TEST_SUITE_P(Modes, ResumeTest, ::testing::Values("fp32", "O1", "O2", "O3", "fp8"));

class DamagedCheckpointTest : public ResumeTest {
 protected:
  /// Trains 4 steps with a checkpoint at the end; returns its bytes.
  std::string make_checkpoint() {
    auto a = args("run", 4);
    a.insert(a.end(), {"--save-every", "2"});
    const Exit e = run(a, dir_.path() / "first.log");
    EXPECT_EQ(e.status, 0) << e.output;
    return read_bytes(checkpoint("run"));
  }
  /// Resumes with `extra` flags; expects failure naming `needles`, and the
  /// checkpoint left exactly as `before`.
  void expect_refused(const std::string& before, const std::vector<std::string>& needles,
                      const std::string& precision = "", const std::string& d_model = "32") {
    auto a = args("run", 8, precision, d_model);
    a.insert(a.end(), {"--save-every", "2", "--resume"});
    const Exit e = run(a, dir_.path() / "resume.log");
    EXPECT_EQ(e.status, 1) << e.output;
    for (const auto& n : needles) {
      EXPECT_NE(e.output.find(n), std::string::npos) << "missing '" << n << "' in:\n" << e.output;
    }
    EXPECT_EQ(read_bytes(checkpoint("run")), before) << "the checkpoint was modified";
  }
};

TEST_P(DamagedCheckpointTest, FlippedByteIsRefusedAndKept) {
  std::string bytes = make_checkpoint();
  bytes[bytes.size() / 2] ^= 0x10;
  write_bytes(checkpoint("run"), bytes);
  expect_refused(bytes, {checkpoint("run").string(), "is corrupted"});
}

TEST_P(DamagedCheckpointTest, TruncatedFileIsRefusedAndKept) {
  std::string bytes = make_checkpoint();
  bytes.resize(bytes.size() * 2 / 3);
  write_bytes(checkpoint("run"), bytes);
  expect_refused(bytes, {checkpoint("run").string(), "is truncated"});
}

TEST_P(DamagedCheckpointTest, CheckpointOfAnotherPrecisionIsRefusedAndKept) {
  const std::string bytes = make_checkpoint();
  const std::string other = GetParam() == "O2" ? "O1" : "O2";
  // The checkpoint sits where a single run of `other` looks for its own.
  expect_refused(bytes,
                 {"precision=\"" + GetParam() + "\"", "this run has precision=\"" + other + "\""},
                 other);
}

TEST_P(DamagedCheckpointTest, CheckpointOfAnotherModelShapeIsRefusedAndKept) {
  const std::string bytes = make_checkpoint();
  expect_refused(bytes, {"d_model=32", "this run has d_model=64"}, "", "64");
}

INSTANTIATE_TEST_SUITE_P(Modes, DamagedCheckpointTest, ::testing::Values("O2"));

#endif  // AMPX_TRAIN_BINARY

}  // namespace
