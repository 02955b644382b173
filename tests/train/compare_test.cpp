// --compare through the real binary: one process per mode, the table as
// markdown and JSON, the plot (or its data and a note when gnuplot is
// missing), per-mode checkpoints that --resume picks up again.

#include "machine.h"
#include "run/checkpoint.h"
#include "test_support.h"

#include <ampx/dist.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using ampx::train::test::Metrics;
using ampx::train::test::metrics_field;
using ampx::train::test::read_metrics;

namespace {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, v);
  return buf;
}

#ifdef AMPX_TRAIN_BINARY

class CompareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ampx::train::test::write_text_data(dir_ / "data", "abcdefgh ", 20000, 3);
  }

  /// The binary with the tiny gpt flags, writing to `out`.
  std::string command(const std::string& out) const {
    std::string cmd = std::string("'") + AMPX_TRAIN_BINARY + "'";
    for (const auto& a : ampx::train::test::tiny_gpt(
             {{"--data-dir", (dir_ / "data").string()}, {"--out-dir", (dir_ / out).string()}})) {
      cmd += " '" + a + "'";
    }
    return cmd + " ";
  }

  /// Runs `cmd` through the shell; its output in `output_`, its exit code returned.
  int shell(const std::string& cmd) {
    const int status = std::system((cmd + " > '" + (dir_ / "log").string() + "' 2>&1").c_str());
    output_ = ampx::train::test::read_bytes(dir_ / "log");
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  /// Runs the binary with the tiny gpt flags plus `extra`; output in `output_`.
  int run(const std::string& extra, const std::string& out = "out") {
    return shell(command(out) + extra);
  }

  ampx::train::test::TempDir tmp_{"ampx-compare"};
  const fs::path dir_ = tmp_.path();
  std::string output_;
};

/// The printed table's row of mode `m` of compare.json (base: the baseline's), cell by cell.
std::string table_row(const nlohmann::json& m, const nlohmann::json& base) {
  const std::string mode = m.at("mode");
  const double mem = double(m.at("peak_allocated_bytes").get<int64_t>()) /
                         base.at("peak_allocated_bytes").get<int64_t>() -
                     1;
  return "| " + mode + " | " + m.at("dtype").get<std::string>() + " | " +
         fmt("%.0f", m.at("tokens_per_s").get<double>()) + " | " +
         fmt("%.2fx", m.at("speedup").get<double>()) + " | " +
         fmt("%.1f", m.at("median_step_ms").get<double>()) + " | " +
         fmt("%.1f", m.at("peak_allocated_bytes").get<int64_t>() / 1048576.0) + " | " +
         (mode == "fp32" ? std::string("-") : fmt("%+.1f%%", 100 * mem)) + " | " +
         fmt("%.2f", m.at("optimizer_bytes_per_param").get<double>()) + " | " +
         fmt("%.4f", m.at("train_loss").get<double>()) + " | " +
         fmt("%.4f", m.at("test_loss").get<double>()) + " | " +
         fmt("%.3f", m.at("test_bpc").get<double>()) + " | " +
         std::to_string(m.at("skipped_steps").get<int64_t>()) + " | " +
         fmt("%g", m.at("final_loss_scale").get<double>()) + " |";
}

/// Checks that mode's plot data (loss-<mode>.dat in `out`) hold every step's loss of `metrics`.
void expect_plot_data(const fs::path& out, const std::string& mode, const Metrics& metrics) {
  std::ifstream dat(out / ("loss-" + mode + ".dat"));
  std::string line;
  std::getline(dat, line);  // header
  for (size_t s = 0; s < metrics.losses.size(); ++s) {
    double step = 0, loss = 0, ema = 0;
    ASSERT_TRUE(dat >> step >> loss >> ema) << mode << " step " << s;
    EXPECT_EQ(step, s + 1);
    EXPECT_NEAR(loss, metrics.losses[s], 1e-5 * std::abs(metrics.losses[s])) << mode;
  }
}

TEST_F(CompareTest, TrainsEachModeAndWritesTableJsonAndPlotData) {
  ASSERT_EQ(run("--steps 6 --compare fp32,O2,O3"), 0) << output_;
  std::ifstream in(dir_ / "out" / "compare.json");
  const auto j = nlohmann::json::parse(in);
  ASSERT_EQ(j.at("modes").size(), 3u);
  EXPECT_EQ(j.at("baseline"), "fp32");
  EXPECT_EQ(j.at("modes")[0].at("speedup"), 1.0);
  for (const auto& m : j.at("modes")) {
    EXPECT_EQ(m.at("steps"), 6);
    EXPECT_GT(m.at("tokens_per_s").get<double>(), 0) << m.dump();
    EXPECT_GT(m.at("peak_allocated_bytes").get<int64_t>(), 0) << m.dump();
    EXPECT_TRUE(std::isfinite(m.at("test_loss").get<double>())) << m.dump();
    EXPECT_EQ(m.at("dtype"), m.at("mode") == "fp32" ? "fp32" : "bf16");
    EXPECT_TRUE(
        fs::exists(dir_ / "out" / ("metrics-" + m.at("mode").get<std::string>() + ".jsonl")));
    EXPECT_TRUE(fs::exists(dir_ / "out" / ("loss-" + m.at("mode").get<std::string>() + ".dat")));
  }
  // bf16 weights and activations hold less than fp32 ones.
  EXPECT_LT(j.at("modes")[2].at("peak_allocated_bytes").get<int64_t>(),
            j.at("modes")[0].at("peak_allocated_bytes").get<int64_t>());
  // The JSON's numbers are the ones each mode's metrics file and the printed
  // table show.
  const auto& base = j.at("modes")[0];
  for (const auto& m : j.at("modes")) {
    const std::string mode = m.at("mode");
    const Metrics metrics = read_metrics(dir_ / "out" / ("metrics-" + mode + ".jsonl"));
    ASSERT_EQ(metrics.losses.size(), 6u) << mode;
    // 6 steps: the first is warm-up, the other 5 are timed; the train loss is
    // the mean of the last tenth (one step).
    const std::vector<double> timed(metrics.step_ms.begin() + 1, metrics.step_ms.end());
    double sum = 0;
    for (double t : timed) sum += t;
    EXPECT_EQ(m.at("timed_steps"), 5) << mode;
    EXPECT_NEAR(m.at("tokens_per_s").get<double>(), 4 * 8 * 1000.0 * 5 / sum,
                1e-9 * m.at("tokens_per_s").get<double>())
        << mode;
    std::vector<double> sorted = timed;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_DOUBLE_EQ(m.at("median_step_ms").get<double>(), sorted[2]) << mode;
    EXPECT_DOUBLE_EQ(m.at("train_loss").get<double>(), metrics.losses.back()) << mode;
    EXPECT_EQ(m.at("skipped_steps").get<size_t>(), metrics.skipped_steps.size()) << mode;
    EXPECT_DOUBLE_EQ(m.at("final_loss_scale").get<double>(), metrics.scales.back()) << mode;
    EXPECT_DOUBLE_EQ(m.at("speedup").get<double>(),
                     m.at("tokens_per_s").get<double>() / base.at("tokens_per_s").get<double>())
        << mode;
    EXPECT_DOUBLE_EQ(m.at("peak_vs_baseline").get<double>(),
                     double(m.at("peak_allocated_bytes").get<int64_t>()) /
                         base.at("peak_allocated_bytes").get<int64_t>())
        << mode;
    // The plot's data: every step's loss.
    ASSERT_NO_FATAL_FAILURE(expect_plot_data(dir_ / "out", mode, metrics));
    // The printed row, cell by cell.
    const std::string row = table_row(m, base);
    EXPECT_NE(output_.find(row), std::string::npos) << row << "\n" << output_;
  }
  // The table is printed and written; the plot exists or the run says why not.
  EXPECT_NE(output_.find("| mode | dtype | tokens/s | speed-up |"), std::string::npos) << output_;
  EXPECT_TRUE(fs::exists(dir_ / "out" / "compare.md"));
  EXPECT_TRUE(fs::exists(dir_ / "out" / "compare.gp"));
  if (std::system("command -v gnuplot >/dev/null 2>&1") == 0) {
    EXPECT_TRUE(fs::exists(dir_ / "out" / "compare.png")) << output_;
  } else {
    EXPECT_NE(output_.find("plot:    none: gnuplot is not installed"), std::string::npos)
        << output_;
  }
}

// Issue 66: the main job's console showed LibTorch's "Overriding a
// previously registered kernel" warning (8 lines, twice) on LibTorch 2.x,
// where O1's and O2's cast policies replace PyTorch's own autocast kernels
// (scaled_dot_product_attention, linalg_cond): it read as a bug. ampx drops
// exactly that warning while it registers its kernels.
TEST_F(CompareTest, TheConsoleShowsNoDispatcherWarningAboutAmpxsKernels) {
  ASSERT_EQ(run("--steps 2 --compare fp32,O1,O2"), 0) << output_;
  EXPECT_EQ(output_.find("Overriding a previously registered kernel"), std::string::npos)
      << output_;
}

// Issue 12.1: `make run` chose the BLAS when make parsed the Makefile, before
// it installed libopenblas0-openmp, so a first run's fp32 baseline ran on the
// pthreads build (2x slower) and every speed-up looked 2x better. The choice
// is ampx-train's now, at run time: `make run`'s command line, started as on a
// fresh machine (no LD_LIBRARY_PATH), trains every mode on the OpenMP build.
TEST_F(CompareTest, MakeRunsCommandTrainsFp32OnTheOpenMpBlasWhenItIsInstalled) {
  const fs::path omp = ampx::train::openblas_openmp_dir();
  if (omp.empty()) GTEST_SKIP() << "OpenBLAS's OpenMP build is not installed (libopenblas0-openmp)";
  const std::string fresh =
      "env -u LD_LIBRARY_PATH -u AMPX_TRAIN_BLAS -u AMPX_TRAIN_BLAS_SWITCHED ";
  ASSERT_EQ(shell(fresh + command("out") + "--steps 2 --compare fp32,O1,O2"), 0) << output_;
  auto modes = [&](const std::string& out) {
    std::ifstream in(dir_ / out / "compare.json");
    return nlohmann::json::parse(in).at("modes");
  };
  const auto chosen = modes("out");
  ASSERT_EQ(chosen.size(), 3u);
  EXPECT_EQ(chosen[0].at("mode"), "fp32");
  // What each mode's process had mapped (machine.cpp reads /proc/self/maps there).
  for (const auto& m : chosen)
    EXPECT_EQ(m.at("blas").get<std::string>(), "OpenBLAS (openmp)") << m.dump();
  EXPECT_TRUE(ampx::train::test::contains(output_, {"BLAS (fp32)", "OpenBLAS (openmp)"}))
      << output_;

  // AMPX_TRAIN_BLAS=keep: the loader's choice, here the system's alternative.
  ASSERT_EQ(shell(fresh + "AMPX_TRAIN_BLAS=keep " + command("kept") + "--steps 2 --compare fp32"),
            0)
      << output_;
  const std::string system_lib = fs::canonical(omp.parent_path() / "libopenblas.so.0").string();
  const std::string expected = system_lib.find("/openblas-pthread/") != std::string::npos
                                   ? "OpenBLAS (pthread)"
                                   : "OpenBLAS (openmp)";
  EXPECT_EQ(modes("kept")[0].at("blas").get<std::string>(), expected) << system_lib;
  EXPECT_TRUE(ampx::train::test::contains(output_, {"AMPX_TRAIN_BLAS=keep"})) << output_;
}

TEST_F(CompareTest, ResumesEveryModeFromItsOwnCheckpoint) {
  ASSERT_EQ(run("--steps 4 --compare O1,O2 --save-every 2"), 0) << output_;
  EXPECT_TRUE(fs::exists(dir_ / "out" / "checkpoints" / "O1" / "checkpoint.ampx"));
  EXPECT_TRUE(fs::exists(dir_ / "out" / "checkpoints" / "O2" / "checkpoint.ampx"));
  ASSERT_EQ(run("--steps 8 --compare O1,O2 --save-every 2 --resume"), 0) << output_;
  std::ifstream in(dir_ / "out" / "compare.json");
  const auto j = nlohmann::json::parse(in);
  for (const auto& m : j.at("modes")) EXPECT_EQ(m.at("steps"), 8);
  // Each metrics file holds steps 0..7 once.
  std::ifstream metrics(dir_ / "out" / "metrics-O2.jsonl");
  int64_t expected = 0;
  for (std::string line; std::getline(metrics, line); ++expected) {
    EXPECT_EQ(nlohmann::json::parse(line).at("step"), expected);
  }
  EXPECT_EQ(expected, 8);
}

TEST_F(CompareTest, AFailingModeFailsTheComparisonWithItsMessage) {
  // O2 needs a checkpoint to resume from and has none: the run stops there.
  ASSERT_EQ(run("--steps 2 --compare fp32 --save-every 1"), 0) << output_;
  EXPECT_EQ(run("--steps 4 --compare fp32,O2 --save-every 1 --resume"), 1) << output_;
  EXPECT_NE(output_.find("no checkpoint at"), std::string::npos) << output_;
  EXPECT_NE(output_.find("training O2 failed"), std::string::npos) << output_;
}

TEST_F(CompareTest, ProfileWritesATraceAndPrintsTheTopOps) {
  ASSERT_EQ(
      run("--steps 4 --precision O2 --profile '" + (dir_ / "prof" / "trace.json").string() + "'"),
      0)
      << output_;
  std::ifstream in(dir_ / "prof" / "trace.json");
  const auto trace = nlohmann::json::parse(in);
  const auto& events = trace.is_array() ? trace : trace.at("traceEvents");
  // The Linear layers' products (gpt applies them to 2-D views: addmm).
  bool saw_addmm = false;
  for (const auto& e : events) saw_addmm = saw_addmm || e.value("name", "") == "aten::addmm";
  EXPECT_TRUE(saw_addmm) << "no aten::addmm in the trace";
  EXPECT_NE(output_.find("[O2] profile of step 3"), std::string::npos) << output_;
  EXPECT_NE(output_.find("op (inclusive time)"), std::string::npos) << output_;
}

// --memory-origins N: each mode's peak by where it came from, its N largest
// origins then the rest as one, in the console's table and compare.json; the
// bytes sum to the mode's peak, and the origins are the step's phases. The
// weights, made in the set-up, live through every step's peak.
TEST_F(CompareTest, MemoryOriginsSumToEachModesPeak) {
  ASSERT_EQ(run("--steps 3 --compare fp32,O2 --memory-origins 3"), 0) << output_;
  EXPECT_NE(output_.find("where each mode's peak came from:"), std::string::npos) << output_;
  std::ifstream in(dir_ / "out" / "compare.json");
  const auto j = nlohmann::json::parse(in);
  const std::vector<std::string> phases = {"set-up",   "forward",   "loss",
                                           "backward", "optimizer", ""};
  for (const auto& m : j.at("modes")) {
    const auto& origins = m.at("memory_origins");
    ASSERT_EQ(origins.size(), 4u) << m.dump();
    int64_t sum = 0;
    for (const auto& o : origins) {
      sum += o.at("bytes").get<int64_t>();
      EXPECT_GT(o.at("blocks").get<int64_t>(), 0) << o.dump();
      if (&o == &origins.back()) continue;
      EXPECT_NE(std::find(phases.begin(), phases.end(), o.at("phase").get<std::string>()),
                phases.end())
          << o.dump();
    }
    EXPECT_EQ(origins.back().at("phase"), "(others)");
    EXPECT_EQ(sum, m.at("peak_allocated_bytes").get<int64_t>()) << m.dump();
  }
}

// --recompute runs blocks (or their MLP's tail) again in backward through
// ampx::checkpoint: the same gradients, so the same weights bit for bit, in
// each mode's forward region (O1's autocast, O2's fp32 norms and products,
// O3's products). With wide products (as the tests run), O2's mlp runs only
// GELU again (ampx::wide_gelu_linear); O1's and O3's, whose GELU is not
// ampx::mixed_gelu, run GELU and the product again.
TEST_F(CompareTest, RecomputeTrainsTheSameWeightsBitForBit) {
  for (const std::string workload : {"gpt", "gpt-nn"}) {
    for (const std::string mode : {"O1", "O2", "O3"}) {
      if (workload == "gpt-nn" && mode == "O1") continue;
      std::vector<std::pair<std::string, torch::Tensor>> plain;
      std::vector<double> plain_losses;
      for (const std::string recompute : {"none", "mlp", "blocks"}) {
        const std::string out = workload + "-" + mode + "-" + recompute;
        std::string cmd = std::string("'") + AMPX_TRAIN_BINARY + "'";
        for (const auto& a : ampx::train::test::tiny_gpt({{"--workload", workload},
                                                          {"--layers", "2"},
                                                          {"--steps", "3"},
                                                          {"--save-every", "3"},
                                                          {"--precision", mode},
                                                          {"--recompute", recompute},
                                                          {"--data-dir", (dir_ / "data").string()},
                                                          {"--out-dir", (dir_ / out).string()}})) {
          cmd += " '" + a + "'";
        }
        ASSERT_EQ(shell(cmd), 0) << output_;
        const auto path = dir_ / out / "checkpoints" / "checkpoint.ampx";
        const auto weights = ampx::train::test::model_tensors(path);
        const auto losses =
            ampx::train::read_checkpoint(path).meta.at("losses").get<std::vector<double>>();
        if (recompute == "none") {
          plain = weights;
          plain_losses = losses;
          continue;
        }
        EXPECT_NE(output_.find("recompute     " + recompute + ":"), std::string::npos) << output_;
        EXPECT_EQ(losses, plain_losses) << out;
        ASSERT_EQ(weights.size(), plain.size()) << out;
        for (size_t i = 0; i < weights.size(); ++i) {
          EXPECT_TRUE(torch::equal(weights[i].second, plain[i].second))
              << out << ": " << weights[i].first;
        }
      }
    }
  }
}

TEST_F(CompareTest, NprocTwoTrainsLikeOneProcessOnTheSameGlobalBatch) {
  if (!ampx::dist::is_available()) GTEST_SKIP() << "ampx built without c10d/Gloo";
  ASSERT_EQ(run("--steps 6 --precision fp32 --save-every 6", "one"), 0) << output_;
  ASSERT_EQ(run("--steps 6 --precision fp32 --save-every 6 --nproc 2", "two"), 0) << output_;
  EXPECT_NE(output_.find("processes     2"), std::string::npos) << output_;
  const auto one = ampx::train::read_checkpoint(dir_ / "one" / "checkpoints" / "checkpoint.ampx");
  const auto two = ampx::train::read_checkpoint(dir_ / "two" / "checkpoints" / "checkpoint.ampx");
  const auto l1 = one.meta.at("losses").get<std::vector<double>>();
  const auto l2 = two.meta.at("losses").get<std::vector<double>>();
  ASSERT_EQ(l1.size(), 6u);
  ASSERT_EQ(l2.size(), 6u);
  // The same global batch, split over two ranks and averaged: the same
  // training up to fp32 summation order.
  for (size_t i = 0; i < l1.size(); ++i) EXPECT_NEAR(l1[i], l2[i], 1e-4) << "step " << i;
  EXPECT_NE(l1, std::vector<double>(6, l1[0]));  // it trained
  // Rank 0 alone wrote the metrics: each step once.
  std::ifstream metrics(dir_ / "two" / "metrics-fp32.jsonl");
  int64_t lines = 0;
  for (std::string line; std::getline(metrics, line);) ++lines;
  EXPECT_EQ(lines, 6);
  const Metrics m2 = read_metrics(dir_ / "two" / "metrics-fp32.jsonl");
  EXPECT_EQ(m2.steps, (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(m2.losses, l2) << "the metrics show the global batch's loss, as the checkpoint does";
  // bf16 weights and gradients (O2) cross Gloo too (as float32 where, as in
  // LibTorch 1.13, it cannot sum bfloat16), and train as one process does on
  // the same global batch, up to bf16 rounding of the averaged gradients.
  ASSERT_EQ(run("--steps 3 --precision O2 --save-every 3", "o2-one"), 0) << output_;
  ASSERT_EQ(run("--steps 3 --precision O2 --save-every 3 --nproc 2", "o2"), 0) << output_;
  const auto o2_one =
      ampx::train::read_checkpoint(dir_ / "o2-one" / "checkpoints" / "checkpoint.ampx")
          .meta.at("losses")
          .get<std::vector<double>>();
  const auto o2_two = ampx::train::read_checkpoint(dir_ / "o2" / "checkpoints" / "checkpoint.ampx")
                          .meta.at("losses")
                          .get<std::vector<double>>();
  ASSERT_EQ(o2_one.size(), 3u);
  ASSERT_EQ(o2_two.size(), 3u);
  EXPECT_NEAR(o2_one[0], o2_two[0], 1e-4) << "the same weights and global batch at step 0";
  for (size_t i = 1; i < 3; ++i) EXPECT_NEAR(o2_one[i], o2_two[i], 1e-2) << "step " << i;
}

// Mode fp8 over two processes: the amaxes are max-reduced over the ranks
// (TE's reduce_amax), so each cast sees the global batch's amax, as one
// process does: the same scales, the same training up to bf16 rounding.
TEST_F(CompareTest, Fp8OverTwoProcessesReducesTheAmaxesToTheGlobalBatchs) {
  if (!ampx::dist::is_available()) GTEST_SKIP() << "ampx built without c10d/Gloo";
  ASSERT_EQ(run("--steps 3 --precision fp8 --amax-history 4 --save-every 3", "fp8-one"), 0)
      << output_;
  ASSERT_EQ(run("--steps 3 --precision fp8 --amax-history 4 --save-every 3 --nproc 2", "fp8-two"),
            0)
      << output_;
  EXPECT_NE(output_.find("fp8 recipe    delayed(hybrid, history 4, max, margin 0)"),
            std::string::npos)
      << output_;
  auto read = [&](const std::string& run) {
    return ampx::train::read_checkpoint(dir_ / run / "checkpoints" / "checkpoint.ampx");
  };
  const auto one = read("fp8-one").meta.at("losses").get<std::vector<double>>();
  const auto two = read("fp8-two").meta.at("losses").get<std::vector<double>>();
  ASSERT_EQ(one.size(), 3u);
  ASSERT_EQ(two.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(one[i], two[i], 1e-2) << "step " << i;
  // The first block's input amax (the embeddings' LayerNorm output) over
  // the three steps: the global batch's on both.
  const auto h1 = metrics_field(dir_ / "fp8-one" / "metrics-fp8.jsonl", "fp8_input_amax");
  const auto h2 = metrics_field(dir_ / "fp8-two" / "metrics-fp8.jsonl", "fp8_input_amax");
  ASSERT_EQ(h1.size(), 3u);
  ASSERT_EQ(h2.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(h1[i], h2[i], 1e-3 * h1[i]) << "step " << i;
  EXPECT_EQ(h1[0], h2[0]) << "step 0: the same weights and batch, the same amax";
}

TEST_F(CompareTest, TorchrunNoPythonStartsRanksThatTrainAsNprocDoes) {
  if (!ampx::dist::is_available()) GTEST_SKIP() << "ampx built without c10d/Gloo";
  // The leg's own torchrun, beside its Python: Debian's /usr/bin/torchrun
  // (python3-torch) on the Debian legs, the wheel's on the wheel leg, whose
  // ranks' TCPStore client must speak its agent's protocol (1.13's agent
  // and 2.15's ranks never agree: "failed to connect/validate").
  const fs::path torchrun = fs::path(AMPX_PYTHON).parent_path() / "torchrun";
  if (!fs::exists(torchrun)) GTEST_SKIP() << "no " << torchrun << " beside " << AMPX_PYTHON;
  ASSERT_EQ(run("--steps 6 --precision fp32 --save-every 6 --nproc 2", "nproc"), 0) << output_;
  // The real launcher: its agent serves the TCPStore on MASTER_PORT and the
  // ranks join it (TORCHELASTIC_USE_AGENT_STORE). Underscored flags are the
  // ones both 1.13 and 2.6 take; 1.13 on Python 3.11 needs -r/-t to name
  // single streams (its default "0" maps to no stream and crashes).
  const fs::path logs = dir_ / "torchrun-logs";
  const std::string launcher = "timeout 300 " + torchrun.string() +
                               " --no_python --nproc_per_node 2 --master_port " +
                               std::to_string(ampx::dist::free_loopback_port()) +
                               " --max_restarts 0 -r 2 -t 1 --log_dir '" + logs.string() + "' ";
  const int status =
      shell(launcher + command("torchrun") + "--steps 6 --precision fp32 --save-every 6");
  std::string rank_logs;
  if (fs::exists(logs)) {
    for (const auto& f : fs::recursive_directory_iterator(logs)) {
      if (f.is_regular_file()) {
        rank_logs += "== " + f.path().string() + "\n" + ampx::train::test::read_bytes(f.path());
      }
    }
  }
  // ("was build" on 2.6, "was built" on 2.14)
  if (status != 0 &&
      output_.find("use_libuv was requested but PyTorch was buil") != std::string::npos) {
    // Debian's torchrun (2.6, 2.14) makes its agent's TCPStore with libuv,
    // which Debian's LibTorch lacks: the launcher dies before starting any
    // rank (USE_LIBUV=0 does not reach the agent's store).
    GTEST_SKIP() << "this torchrun cannot start: its agent asks for a libuv TCPStore";
  }
  ASSERT_EQ(status, 0) << output_ << rank_logs;
  EXPECT_NE(output_.find("processes     2"), std::string::npos) << output_;
  const auto a = ampx::train::read_checkpoint(dir_ / "nproc" / "checkpoints" / "checkpoint.ampx");
  const auto b =
      ampx::train::read_checkpoint(dir_ / "torchrun" / "checkpoints" / "checkpoint.ampx");
  const auto la = a.meta.at("losses").get<std::vector<double>>();
  const auto lb = b.meta.at("losses").get<std::vector<double>>();
  ASSERT_EQ(la.size(), 6u);
  EXPECT_EQ(la, lb) << "the same ranks, threads and data: the same numbers";
  EXPECT_NE(la, std::vector<double>(6, la[0]));  // it trained
  // Rank 0 alone wrote the metrics, the same numbers as --nproc's.
  const Metrics ta = read_metrics(dir_ / "nproc" / "metrics-fp32.jsonl");
  const Metrics tb = read_metrics(dir_ / "torchrun" / "metrics-fp32.jsonl");
  EXPECT_EQ(tb.steps, (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(ta.losses, tb.losses);
  EXPECT_EQ(tb.losses, lb);
}

#endif  // AMPX_TRAIN_BINARY

}  // namespace
