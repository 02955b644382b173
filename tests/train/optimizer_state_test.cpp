// ampx-train's --masters, --optimizer-state and fp16's loss-scaler flags:
// the settings they resolve to and refuse, a Kahan + 8-bit run resumed from its checkpoint bit for
// bit, and the optimizer's bytes per parameter in compare.json.

#include "run/checkpoint.h"
#include "run/optimizer_options.h"
#include "test_support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

using ampx::train::test::contains;
using ampx::train::test::expect_error_contains;
using ampx::train::test::resolved_config;

TEST(OptimizerStateFlagsTest, ResolveToTheModesMastersAndRefuseWhatCannotWork) {
  auto c = resolved_config({"--compare", "fp32,O2,O3", "--optimizer-state", "8bit"});
  EXPECT_TRUE(contains(ampx::train::settings_table(c),
                       {"moments 8bit; 16-bit weights' lost bits: O2 fp32, O3 stochastic"}));
  c = resolved_config({"--precision", "O2", "--masters", "kahan"});
  EXPECT_TRUE(contains(ampx::train::settings_table(c),
                       {"moments fp32; 16-bit weights' lost bits: O2 kahan"}));
  EXPECT_TRUE(expect_error_contains(
      [] {
        resolved_config({"--precision", "O3", "--masters", "fp32"});
      },
      {"ampx-train: --masters fp32 with --precision O3: O3 trains without masters"}));
#if TORCH_VERSION_MAJOR >= 2  // (1.13 refuses fp16 on the CPU first)
  EXPECT_TRUE(expect_error_contains(
      [] {
        resolved_config({"--precision", "O2", "--masters", "stochastic", "--dtype", "fp16"});
      },
      {"ampx-train: --masters stochastic rounds bf16 weights"}));
#endif
  EXPECT_TRUE(expect_error_contains(
      [] {
        resolved_config({"--nproc", "2", "--shard", "full", "--masters", "kahan"});
      },
      {"ampx-train: --masters kahan with --shard full"}));
  EXPECT_TRUE(expect_error_contains(
      [] {
        resolved_config({"--precision", "O2", "--init-scale", "1024"});
      },
      {"ampx-train: --init-scale sets fp16's loss scaler; --dtype bf16 trains without loss "
       "scaling: add --dtype fp16 or drop the flag"}));
#if TORCH_VERSION_MAJOR >= 2
  c = resolved_config(
      {"--precision", "O2", "--dtype", "fp16", "--init-scale", "1024", "--growth-interval", "5"});
  EXPECT_TRUE(contains(ampx::train::settings_table(c),
                       {"fp16 loss scale from 1024, doubled after 5 clean steps"}));
#endif
  // Sharded checkpoints carry coded moments (FsdpTest.CodedMomentsResume...).
  EXPECT_NO_THROW(resolved_config(
      {"--nproc", "2", "--shard", "grad", "--optimizer-state", "8bit", "--save-every", "10"}));
}

// --compare sets masters and optimizer states side by side: a mode's "+"
// parts are its own --masters and --optimizer-state, said per mode in the
// settings; parts that cannot apply are refused naming the mode.
TEST(OptimizerStateFlagsTest, CompareModesCarryTheirOwnMastersAndOptimizerState) {
  auto c = resolved_config({"--compare", "O2,O2+8bit,O3+kahan+fp8"});
  EXPECT_TRUE(contains(ampx::train::settings_table(c),
                       {"moments O2 fp32, O2+8bit 8bit, O3+kahan+fp8 fp8; 16-bit weights' lost "
                        "bits: O2 fp32, O2+8bit fp32, O3+kahan+fp8 kahan"}));
  const ampx::train::Mode m = ampx::train::parse_mode("O3+kahan+fp8", c);
  EXPECT_EQ(m.name, "O3+kahan+fp8");
  EXPECT_EQ(m.precision, "O3");
  EXPECT_EQ(m.level, ampx::OptLevel::O3);
  EXPECT_EQ(m.masters, "kahan");
  EXPECT_EQ(m.optimizer_state, "fp8");
  EXPECT_EQ(ampx::train::masters_of(c, ampx::train::parse_mode("O2+8bit", c)), "fp32");
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"O1+kahan",
       "mode 'O1+kahan': kahan keeps the lost bits of 16-bit weights, and O1 trains "
       "none (O2 and O3 do)"},
      {"O2+fp32",
       "mode 'O2+fp32': 'fp32' is neither masters (kahan, stochastic) nor an optimizer "
       "state (bf16, fp8, 8bit)"},
      {"O2+", "mode 'O2+': '' is neither masters"},
      {"O2+8bit+bf16", "mode 'O2+8bit+bf16' gives an optimizer state twice"},
      {"fp8+8bit", "mode 'fp8+8bit': fp8 takes --masters and --optimizer-state as flags"},
      {"O4+8bit", "unknown precision mode 'O4+8bit'"}};
  for (const auto& [name, error] : refused) {
    EXPECT_TRUE(
        expect_error_contains([&] { ampx::train::parse_mode(name, c); }, {"ampx-train: " + error}))
        << name;
  }
  EXPECT_TRUE(expect_error_contains(
      [] {
        resolved_config({"--nproc", "2", "--shard", "full", "--compare", "O2,O2+kahan"});
      },
      {"ampx-train: mode O2+kahan's kahan with --shard full"}));
}

#ifdef AMPX_TRAIN_BINARY

using ampx::train::test::Exit;
using ampx::train::test::TempDir;
using ampx::train::test::write_text_data;

class OptimizerStateRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    write_text_data(dir_.path() / "data", "the whale sea ship call me ishmael.\n", 30000, 7);
  }
  // A gpt whose block weights (d 64) are large enough for coded moments.
  std::vector<std::string> args(const std::string& name, int64_t steps, const std::string& masters,
                                const std::string& state) const {
    const auto out = dir_.path() / name;
    return ampx::train::test::tiny_gpt({{"--precision", "O2"},
                                        {"--masters", masters},
                                        {"--optimizer-state", state},
                                        {"--data-dir", (dir_.path() / "data").string()},
                                        {"--out-dir", out.string()},
                                        {"--checkpoint-dir", (out / "ck").string()},
                                        {"--d-model", "64"},
                                        {"--steps", std::to_string(steps)},
                                        {"--seed", "5"}});
  }
  fs::path checkpoint(const std::string& name) const {
    return dir_.path() / name / "ck" / "checkpoint.ampx";
  }
  nlohmann::json compare(const std::string& name) const {
    std::ifstream in(dir_.path() / name / "compare.json");
    return nlohmann::json::parse(in);
  }
  TempDir dir_;
};

TEST_F(OptimizerStateRunTest, KahanAnd8BitRunResumesBitwiseAndKeepsFewerBytes) {
  ampx::train::test::EnvGuard products("AMPX_CPU_PRODUCTS", "native");
  auto whole = args("whole", 24, "kahan", "8bit");
  whole.insert(whole.end(), {"--save-every", "1000"});
  const Exit a = ampx::train::test::run_train(whole, dir_.path() / "whole.log");
  ASSERT_EQ(a.status, 0) << a.output;

  auto half = args("halves", 12, "kahan", "8bit");
  half.insert(half.end(), {"--save-every", "12"});
  const Exit b = ampx::train::test::run_train(half, dir_.path() / "first.log");
  ASSERT_EQ(b.status, 0) << b.output;
  auto rest = args("halves", 24, "kahan", "8bit");
  rest.insert(rest.end(), {"--save-every", "1000", "--resume"});
  const Exit c = ampx::train::test::run_train(rest, dir_.path() / "second.log");
  ASSERT_EQ(c.status, 0) << c.output;

  const auto ca = ampx::train::read_checkpoint(checkpoint("whole"));
  const auto cb = ampx::train::read_checkpoint(checkpoint("halves"));
  EXPECT_EQ(ca.meta.at("losses").get<std::vector<double>>(),
            cb.meta.at("losses").get<std::vector<double>>());
  const auto pa = ampx::train::test::model_tensors(checkpoint("whole"));
  const auto pb = ampx::train::test::model_tensors(checkpoint("halves"));
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(torch::equal(pa[i].second, pb[i].second)) << pa[i].first << " differs";
  }

  // The same model with fp32 masters and moments keeps far more bytes.
  const Exit d =
      ampx::train::test::run_train(args("fp32", 4, "fp32", "fp32"), dir_.path() / "fp32.log");
  ASSERT_EQ(d.status, 0) << d.output;
  const double low = compare("whole")["modes"][0]["optimizer_bytes_per_param"].get<double>();
  const double full = compare("fp32")["modes"][0]["optimizer_bytes_per_param"].get<double>();
  RecordProperty("bytes_per_param_kahan_8bit", std::to_string(low));
  RecordProperty("bytes_per_param_fp32", std::to_string(full));
  EXPECT_GT(full, 11.0);  // fp32 master and two fp32 moments: 12 a parameter
  EXPECT_LT(low, 0.6 * full);
}

// One --compare run trains O2 with fp32 and with 8-bit moments, and O3
// with Kahan weights and 8-bit moments, side by side: its own metrics file
// and row each, the 8-bit ones with fewer optimizer bytes a parameter, O3's
// fewest (a bf16 compensation instead of an fp32 master).
TEST_F(OptimizerStateRunTest, CompareTrainsEachOptimizerStateSideBySide) {
  const auto out = dir_.path() / "side";
  const auto a = ampx::train::test::tiny_gpt({{"--compare", "O2,O2+8bit,O3+kahan+8bit"},
                                              {"--data-dir", (dir_.path() / "data").string()},
                                              {"--out-dir", out.string()},
                                              {"--d-model", "64"},
                                              {"--steps", "4"},
                                              {"--seed", "5"}});
  const Exit e = ampx::train::test::run_train(a, dir_.path() / "side.log");
  ASSERT_EQ(e.status, 0) << e.output;
  const auto modes = compare("side")["modes"];
  ASSERT_EQ(modes.size(), 3u);
  EXPECT_EQ(modes[0]["mode"], "O2");
  EXPECT_EQ(modes[1]["mode"], "O2+8bit");
  EXPECT_EQ(modes[2]["mode"], "O3+kahan+8bit");
  EXPECT_TRUE(fs::exists(dir_.path() / "side" / "metrics-O2+8bit.jsonl"));
  EXPECT_TRUE(contains(e.output, {"O3+kahan+8bit kahan"})) << e.output;
  const auto bytes = [&](size_t i) { return modes[i]["optimizer_bytes_per_param"].get<double>(); };
  EXPECT_LT(bytes(1), 0.6 * bytes(0));
  EXPECT_LT(bytes(2), bytes(1));
}

// Modes named with "+" parts checkpoint and resume under their names: a
// --compare run of O2 with 8-bit moments and O3 with Kahan weights and
// 8-bit moments, stopped at step 8 and resumed to 16, ends each mode with
// the losses and weights of the run that was never stopped, bit for bit.
TEST_F(OptimizerStateRunTest, CompareModesWithPartsResumeBitwise) {
  ampx::train::test::EnvGuard products("AMPX_CPU_PRODUCTS", "native");
  const auto run = [&](const std::string& name, int64_t steps, std::vector<std::string> more) {
    const auto out = dir_.path() / name;
    auto a = ampx::train::test::tiny_gpt({{"--compare", "O2+8bit,O3+kahan+8bit"},
                                          {"--data-dir", (dir_.path() / "data").string()},
                                          {"--out-dir", out.string()},
                                          {"--checkpoint-dir", (out / "ck").string()},
                                          {"--d-model", "64"},
                                          {"--steps", std::to_string(steps)},
                                          {"--seed", "5"}});
    a.insert(a.end(), more.begin(), more.end());
    return ampx::train::test::run_train(a, dir_.path() / (name + std::to_string(steps) + ".log"));
  };
  const Exit whole = run("whole", 16, {"--save-every", "1000"});
  ASSERT_EQ(whole.status, 0) << whole.output;
  const Exit first = run("halves", 8, {"--save-every", "8"});
  ASSERT_EQ(first.status, 0) << first.output;
  const Exit second = run("halves", 16, {"--save-every", "1000", "--resume"});
  ASSERT_EQ(second.status, 0) << second.output;
  for (const std::string mode : {"O2+8bit", "O3+kahan+8bit"}) {
    const auto ck = [&](const std::string& name) {
      return dir_.path() / name / "ck" / mode / "checkpoint.ampx";
    };
    const auto a = ampx::train::read_checkpoint(ck("whole"));
    const auto b = ampx::train::read_checkpoint(ck("halves"));
    const auto losses = a.meta.at("losses").get<std::vector<double>>();
    ASSERT_EQ(losses.size(), 16u) << mode;
    EXPECT_EQ(b.meta.at("losses").get<std::vector<double>>(), losses) << mode;
    const auto pa = ampx::train::test::model_tensors(ck("whole"));
    const auto pb = ampx::train::test::model_tensors(ck("halves"));
    ASSERT_EQ(pa.size(), pb.size()) << mode;
    for (size_t i = 0; i < pa.size(); ++i) {
      EXPECT_TRUE(torch::equal(pa[i].second, pb[i].second)) << mode << " " << pa[i].first;
    }
  }
}

#endif  // AMPX_TRAIN_BINARY

}  // namespace
