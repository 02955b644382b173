// ampx-train's numerics diagnostics (docs/numerics.md), on the real binary:
// --diagnose writes the advisor's report with every layer named by its path;
// --detect-nonfinite and --range-stats leave every step's loss bit for bit as
// it was; --detect-nonfinite=throw stops at the op that made the first inf
// with exit status 3, its report and an intact checkpoint; =warn trains on
// and counts. And the flags' parsing.

#include "run/step_diagnostics.h"
#include "cli/config.h"
#include "run/checkpoint.h"
#include "test_support.h"

#include <ampx/version.h>

#include <gtest/gtest.h>
#include <zlib.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <sys/wait.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using ampx::train::TrainConfig;
using namespace ampx::train::test;

std::optional<int> parse(std::vector<std::string> args, TrainConfig& config) {
  args.insert(args.begin(), "ampx-train");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  testing::internal::CaptureStderr();
  testing::internal::CaptureStdout();
  auto code = ampx::train::parse_command_line(static_cast<int>(argv.size()), argv.data(), config);
  testing::internal::GetCapturedStdout();
  testing::internal::GetCapturedStderr();
  return code;
}

TEST(DiagnosticsFlagsTest, DetectNonfiniteIsAFlagThatTakesAnOptionalAction) {
  TrainConfig none, bare, warn, thrown, bad;
  ASSERT_FALSE(parse({}, none));
  EXPECT_EQ(none.detect_nonfinite, "");
  ASSERT_FALSE(parse({"--detect-nonfinite"}, bare));
  EXPECT_EQ(bare.detect_nonfinite, "throw");
  ASSERT_FALSE(parse({"--detect-nonfinite=warn"}, warn));
  EXPECT_EQ(warn.detect_nonfinite, "warn");
  ASSERT_FALSE(parse({"--detect-nonfinite=throw"}, thrown));
  EXPECT_EQ(thrown.detect_nonfinite, "throw");
  const auto code = parse({"--detect-nonfinite=ignore"}, bad);
  ASSERT_TRUE(code);
  EXPECT_EQ(*code, static_cast<int>(CLI::ExitCodes::ValidationError));
}

TEST(DiagnosticsFlagsTest, DiagnoseTakesStepsAndRefusesWhatItCannotDo) {
  TrainConfig c;
  ASSERT_FALSE(parse({"--diagnose"}, c));
  EXPECT_TRUE(c.diagnose);
  EXPECT_EQ(c.diagnose_steps, 4);
  TrainConfig steps;
  ASSERT_FALSE(parse({"--diagnose", "--diagnose-steps", "2"}, steps));
  EXPECT_EQ(steps.diagnose_steps, 2);
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--diagnose", "--compare", "fp32,O1"},
        {"--diagnose", "--resume"},
        {"--diagnose", "--detect-nonfinite"},
        {"--diagnose", "--range-stats"},
        {"--diagnose-steps", "2"},
        {"--diagnose", "--diagnose-steps", "0"}}) {
    TrainConfig refused;
    const auto code = parse(args, refused);
    EXPECT_TRUE(code && *code != 0) << args.back();
  }
}

#ifdef AMPX_TRAIN_BINARY

void write_fashion(const fs::path& dir, uint32_t train, uint32_t test);

class DiagnosticsTest : public testing::Test {
 protected:
  void SetUp() override {
    write_text_data(dir_.path() / "data", "abcdefghijklmnopqrstuvwxyz     ", 20000, 7);
  }

  BinaryRun run(const std::vector<std::string>& args) {
    return run_binary_in(dir_.path(), AMPX_TRAIN_BINARY, args);
  }

  /// A 2-block gpt small enough to take a moment, writing into <tmp>/<name>.
  std::vector<std::string> gpt(const std::string& name, const std::string& precision = "fp32",
                               int64_t steps = 6) const {
    return ampx::train::test::tiny_gpt({{"--precision", precision},
                                        {"--data-dir", (dir_.path() / "data").string()},
                                        {"--out-dir", (dir_.path() / name).string()},
                                        {"--layers", "2"},
                                        {"--d-model", "32"},
                                        {"--block-size", "16"},
                                        {"--steps", std::to_string(steps)},
                                        {"--seed", "5"}});
  }

  /// fashion-mlp on 64 generated images, batch 16, writing into <tmp>/<name>.
  std::vector<std::string> mlp(const std::string& name, const std::string& precision = "fp32",
                               int64_t steps = 6) {
    if (!fs::exists(dir_.path() / "data" / "fashion-mnist"))
      write_fashion(dir_.path() / "data", 64, 16);
    return {"--workload",   "fashion-mlp",
            "--precision",  precision,
            "--data-dir",   (dir_.path() / "data").string(),
            "--out-dir",    (dir_.path() / name).string(),
            "--batch-size", "16",
            "--steps",      std::to_string(steps),
            "--threads",    "1",
            "--progress",   "none",
            "--seed",       "5"};
  }

  std::vector<double> losses(const std::string& name, const std::string& mode) const {
    std::ifstream in(dir_.path() / name / ("metrics-" + mode + ".jsonl"));
    std::vector<double> out;
    for (std::string line; std::getline(in, line);) {
      const auto loss = nlohmann::json::parse(line).at("loss");  // null: NaN
      out.push_back(loss.is_null() ? std::nan("") : loss.get<double>());
    }
    return out;
  }

  TempDir dir_;
};

/// The scopes diagnose.json's statistics name, and those with gradients.
void scopes_of(const nlohmann::json& stats, std::set<std::string>& forward,
               std::set<std::string>& backward) {
  for (const auto& r : stats.at("records")) {
    (r.at("direction") == "backward" ? backward : forward).insert(r.at("scope").get<std::string>());
  }
}

TEST_F(DiagnosticsTest, DiagnoseGptReportsEveryLayerByItsPathAndRecommendsAPrecision) {
  auto args = gpt("diag");
  args.insert(args.end(), {"--diagnose", "--diagnose-steps", "2"});
  const BinaryRun r = run(args);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const fs::path out = dir_.path() / "diag";
  ASSERT_TRUE(fs::exists(out / "diagnose.md"));
  ASSERT_TRUE(fs::exists(out / "diagnose.json"));
  const std::string md = read_bytes(out / "diagnose.md");
  // Layers by the paths name_modules() gave them, the parametric ones too.
  EXPECT_TRUE(
      contains(md, {"| blocks.0.fc |", "| blocks.1.attn.qkv |", "| blocks.0.attn |", "| head |",
                    "| loss |", "| float16 |", "| bfloat16 |", "**Recommendation:**"}));
  // The console shows the advisor's table, as the file does.
  const auto json = nlohmann::json::parse(read_bytes(out / "diagnose.json"));
  ASSERT_TRUE(json.contains("advice") && json.contains("stats")) << json.dump().substr(0, 400);
  EXPECT_EQ(json.at("steps"), 2);
  EXPECT_EQ(json.at("losses").size(), 2u);
  std::set<std::string> forward, backward;
  scopes_of(json.at("stats"), forward, backward);
  for (const char* scope : {"blocks.0.fc", "blocks.0.out", "blocks.1.attn.proj", "head", "ln_f"}) {
    EXPECT_TRUE(forward.count(scope)) << scope;
    EXPECT_TRUE(backward.count(scope)) << scope;
  }
  // Nothing trained: no metrics, no checkpoint; a picture when gnuplot is here.
  EXPECT_FALSE(fs::exists(out / "metrics-fp32.jsonl"));
  if (std::system("command -v gnuplot >/dev/null 2>&1") == 0) {
    EXPECT_TRUE(fs::exists(out / "diagnose.png")) << r.out;
  }
  EXPECT_TRUE(contains(r.out, {"diagnose.md", "diagnose.json"}));
}

/// Fashion-MNIST's four gzipped IDX files with `train` and `test` seeded
/// random 28x28 images.
void write_fashion(const fs::path& dir, uint32_t train, uint32_t test) {
  std::mt19937 rng(3);
  auto be32 = [](std::string& s, uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>(v >> shift));
  };
  auto gz = [&](const std::string& name, const std::string& bytes) {
    fs::create_directories(dir / "fashion-mnist");
    gzFile f = gzopen((dir / "fashion-mnist" / name).c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
              static_cast<int>(bytes.size()));
    ASSERT_EQ(gzclose(f), Z_OK);
  };
  for (const auto& [prefix, n] :
       {std::pair<std::string, uint32_t>{"train", train}, {"t10k", test}}) {
    std::string images, labels;
    for (uint32_t v : {0x803u, n, 28u, 28u}) be32(images, v);
    for (uint32_t v : {0x801u, n}) be32(labels, v);
    for (uint32_t i = 0; i < n * 784; ++i) images.push_back(static_cast<char>(rng() % 256));
    for (uint32_t i = 0; i < n; ++i) labels.push_back(static_cast<char>(rng() % 10));
    gz(prefix + "-images-idx3-ubyte.gz", images);
    gz(prefix + "-labels-idx1-ubyte.gz", labels);
  }
}

TEST_F(DiagnosticsTest, DiagnoseFashionMlpNamesItsThreeLayers) {
  auto args = mlp("mlp");
  args.insert(args.end(), {"--diagnose", "--diagnose-steps", "2"});
  const BinaryRun r = run(args);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto json = nlohmann::json::parse(read_bytes(dir_.path() / "mlp" / "diagnose.json"));
  std::set<std::string> forward, backward;
  scopes_of(json.at("stats"), forward, backward);
  for (const char* scope : {"fc1", "fc2", "fc3"}) {
    EXPECT_TRUE(forward.count(scope)) << scope;
    EXPECT_TRUE(backward.count(scope)) << scope;
  }
  EXPECT_TRUE(contains(read_bytes(dir_.path() / "mlp" / "diagnose.md"), {"| fc1 |", "| fc3 |"}));
}

class UnchangedNumbersTest : public DiagnosticsTest,
                             public testing::WithParamInterface<std::string> {
 protected:
  /// Runs `args` plain, with --detect-nonfinite (unless !guard) and with
  /// --range-stats; expects the same losses, bit for bit, and statistics
  /// that name `layer`.
  void expect_unchanged(const std::vector<std::string>& args, const std::string& out, bool guard,
                        const std::string& layer) {
    const std::string mode = GetParam();
    // Each run times LibTorch's bf16 products against float32's and picks
    // the faster path (AMPX_CPU_PRODUCTS=auto); on a loaded machine two runs
    // may pick differently and sum in other orders. The runs compared here
    // must multiply alike.
    ampx::train::test::EnvGuard products("AMPX_CPU_PRODUCTS", "native");
    auto with = [&](const std::string& name, const std::vector<std::string>& extra) {
      auto a = args;
      a.insert(a.end(), extra.begin(), extra.end());
      for (size_t i = 0; i + 1 < a.size(); ++i) {
        if (a[i] == "--out-dir") a[i + 1] = (dir_.path() / (out + "-" + name)).string();
      }
      const BinaryRun r = run(a);
      EXPECT_EQ(r.status, 0) << r.out << r.err;
      return losses(out + "-" + name, mode);
    };
    const auto expected = with("plain", {});
    ASSERT_EQ(expected.size(), 6u);
    if (guard) {
      EXPECT_EQ(with("guarded", {"--detect-nonfinite"}), expected);  // JSON doubles round-trip
    }
    EXPECT_EQ(with("watched", {"--range-stats"}), expected);
    const auto stats = nlohmann::json::parse(
        read_bytes(dir_.path() / (out + "-watched") / ("range-stats-" + mode + ".json")));
    std::set<std::string> forward, backward;
    scopes_of(stats, forward, backward);
    EXPECT_TRUE(forward.count(layer)) << layer;
    EXPECT_TRUE(backward.count(layer)) << layer;
  }
};

TEST_P(UnchangedNumbersTest, DetectNonfiniteAndRangeStatsLeaveEveryMlpLossBitForBit) {
  expect_unchanged(mlp("mlp", GetParam()), "mlp", /*guard=*/true, "fc2");
}

TEST_P(UnchangedNumbersTest, DetectNonfiniteAndRangeStatsLeaveEveryGptLossBitForBit) {
  // Also: the attention's masked_fill(-inf), written on purpose, is no fault.
  expect_unchanged(gpt("gpt", GetParam()), "gpt", /*guard=*/true, "blocks.1.fc");
}

INSTANTIATE_TEST_SUITE_P(Modes, UnchangedNumbersTest, testing::Values("fp32", "O1", "O2", "O3"));

// lr 1e30: AdamW's first step moves every weight by about 1e30, and the
// second step's fc2 (inputs ~1e32 from fc1, weights ~1e30) overflows fp32.
TEST_F(DiagnosticsTest, ThrowStopsAtTheOpThatOverflowedWithItsReportAndExitStatus3) {
  auto args = mlp("boom");
  args.insert(args.end(), {"--lr", "1e30", "--detect-nonfinite", "--save-every", "1",
                           "--checkpoint-dir", (dir_.path() / "ck").string()});
  const BinaryRun r = run(args);
  EXPECT_EQ(r.status, ampx::train::kExitNonFinite) << r.out << r.err;
  EXPECT_TRUE(contains(
      r.err, {"ampx-train: --detect-nonfinite stopped the run: non-finite values from aten::addmm "
              "in forward, scope 'fc2', step 1: ",
              "(parameter fc2.weight)", "this op created the non-finite values",
              "Nothing was saved for this step"}));
  // The checkpoint of step 0 is whole: it reads back, at step 1.
  const auto c = ampx::train::read_checkpoint(dir_.path() / "ck" / "checkpoint.ampx");
  EXPECT_EQ(c.meta.at("step"), 1);
  EXPECT_EQ(losses("boom", "fp32").size(), 1u);
}

// The same on gpt: AdamW's 1e30 step makes the first layer norm's input
// ~2e30, whose variance overflows fp32.
TEST_F(DiagnosticsTest, ThrowNamesTheGptLayerWhoseNormOverflowed) {
  auto args = gpt("gpt-boom");
  args.insert(args.end(), {"--lr", "1e30", "--detect-nonfinite"});
  const BinaryRun r = run(args);
  EXPECT_EQ(r.status, ampx::train::kExitNonFinite) << r.out << r.err;
  EXPECT_TRUE(contains(r.err, {"non-finite values from aten::native_layer_norm in forward, scope "
                               "'blocks.0.ln1', step 1: ",
                               "(parameter blocks.0.ln1.weight)"}));
}

TEST_F(DiagnosticsTest, ThrowEndsACompareRunWithTheSameExitStatus) {
  auto args = mlp("boom-compare");
  args.erase(args.begin() + 2, args.begin() + 4);  // --precision fp32
  args.insert(args.end(), {"--compare", "fp32,O2", "--lr", "1e30", "--detect-nonfinite"});
  const BinaryRun r = run(args);
  EXPECT_EQ(r.status, ampx::train::kExitNonFinite) << r.out << r.err;
  EXPECT_TRUE(contains(r.err, {"scope 'fc2', step 1: ",
                               "ampx-train: --detect-nonfinite stopped fp32; the comparison ends "
                               "here"}));
}

TEST_F(DiagnosticsTest, WarnTrainsOnAndTheSummaryCountsAndQuotesTheFirst) {
  auto args = mlp("warned");
  args.insert(args.end(), {"--lr", "1e30", "--detect-nonfinite=warn"});
  const BinaryRun r = run(args);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_EQ(losses("warned", "fp32").size(), 6u);
  EXPECT_TRUE(contains(r.out, {"[fp32] --detect-nonfinite=warn: ",
                               " non-finite op outputs in 5 steps; the first: non-finite values "
                               "from aten::addmm in forward, scope 'fc2', step 1: "}));
  EXPECT_TRUE(contains(r.err, {"ampx::debug::NonFiniteGuard: non-finite values from "}));
}

// fp16 with loss scaling (GradScaler, dynamic) under the guard: the same
// losses as without. LibTorch 2.x only (fp16 on the CPU).
TEST_F(DiagnosticsTest, Fp16WithLossScalingTrainsTheSameUnderTheGuard) {
  ampx::train::test::EnvGuard products("AMPX_CPU_PRODUCTS", "native");  // one path in every run
  if (std::string(ampx::torch_version()).rfind("1.", 0) == 0) {
    GTEST_SKIP() << "fp16 on CPU needs LibTorch 2.x; this is " << ampx::torch_version();
  }
  auto args = mlp("fp16-plain", "O1");
  args.insert(args.end(), {"--dtype", "fp16"});
  const BinaryRun plain = run(args);
  ASSERT_EQ(plain.status, 0) << plain.err;
  args = mlp("fp16-warn", "O1");
  args.insert(args.end(), {"--dtype", "fp16", "--detect-nonfinite=warn"});
  const BinaryRun warned = run(args);
  ASSERT_EQ(warned.status, 0) << warned.out << warned.err;
  const auto expected = losses("fp16-plain", "O1");
  ASSERT_EQ(expected.size(), 6u);
  EXPECT_EQ(losses("fp16-warn", "O1"), expected);
}

#endif  // AMPX_TRAIN_BINARY

}  // namespace
