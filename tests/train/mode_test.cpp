// Each precision mode as ampx-train sets it up and steps it (set_up_mode and
// train_step, the code train_mode runs): the dtype the model's matrix
// products come out in under the mode's forward, the weights' dtype, the
// masters, the loss scale. Issue 19.1: mapping O1 to O0 in the trainer
// trained "O1" in fp32 and every other train test still passed.

#include "config.h"
#include "test_support.h"
#include "trainer.h"
#include "workloads.h"

#include <algorithm>
#include <cmath>

#include <ampx/version.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ostream>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace ampx::train;
using namespace ampx::train::test;

struct ModeCase {
  std::string mode;   // fp32 | O1 | O2 | O3
  std::string dtype;  // --dtype: bf16 | fp16
};

void PrintTo(const ModeCase& c, std::ostream* os) {
  *os << c.mode << " in " << c.dtype;
}

std::string case_name(const testing::TestParamInfo<ModeCase>& info) {
  return info.param.mode + "_" + info.param.dtype;
}

class ModeTest : public testing::TestWithParam<ModeCase> {
 protected:
  void SetUp() override {
    if (GetParam().dtype == "fp16" && std::string(ampx::torch_version()).rfind("1.", 0) == 0) {
      GTEST_SKIP() << "fp16 on CPU needs LibTorch 2.x; this is " << ampx::torch_version();
    }
    write_text_data(tmp_.path() / "data", "abcdefgh ", 20000, 3);
    std::vector<std::string> args = {"ampx-train"};
    for (auto& a : ampx::train::test::tiny_gpt({{"--precision", GetParam().mode},
                                                {"--dtype", GetParam().dtype},
                                                {"--data-dir", (tmp_.path() / "data").string()},
                                                {"--out-dir", (tmp_.path() / "out").string()},
                                                {"--steps", "2"}})) {
      args.push_back(std::move(a));
    }
    std::vector<const char*> argv;
    for (const auto& a : args) argv.push_back(a.c_str());
    ASSERT_FALSE(parse_command_line(static_cast<int>(argv.size()), argv.data(), config_));
    resolve_defaults(config_);
    workload_ = make_workload(config_);
  }

  TempDir tmp_{"ampx-mode"};
  TrainConfig config_;
  std::unique_ptr<Workload> workload_;
};

TEST_P(ModeTest, SetsUpAndStepsTheModeAsItIsDefined) {
  const auto& [mode, dtype] = GetParam();
  const auto low = dtype == "fp16" ? torch::kHalf : torch::kBFloat16;
  // What each mode is (docs/ampx-train.md; Apex's table, ampx/amp.h):
  //   fp32: fp32 weights and products, no masters, no loss scale
  //   O1:   fp32 weights, low-precision products (autocast), no masters
  //         (fp32 weights are their own), loss scale with fp16
  //   O2:   low-precision weights (norm layers fp32), fp32 masters, loss scale with fp16
  //   O3:   low-precision weights and products, no masters, no loss scale
  //   fp8:  O1 with every Linear whose dimensions are multiples of 16 in FP8
  const bool low_products = mode != "fp32";
  const bool low_weights = mode == "O2" || mode == "O3";
  const bool masters = mode == "O2";
  const bool scaled = dtype == "fp16" && (mode == "O1" || mode == "O2");

  const torch::Device cpu(torch::kCPU);
  ModeSetUp setup = set_up_mode(config_, *workload_, parse_mode(mode, config_), cpu);
  const Batch batch = workload_->batch(0, cpu);
  {
    torch::NoGradGuard no_grad;
    auto guard = setup.amp->forward_guard();
    // gpt's output: the logits of its last matrix product, before the fp32
    // cast for the loss.
    const auto logits = setup.model_output(batch.input);
    EXPECT_EQ(logits.scalar_type(), low_products ? low : torch::kFloat) << mode;
    // The loss reads fp32 in every mode.
    EXPECT_EQ(setup.forward(batch.input).scalar_type(), torch::kFloat) << mode;
  }
  EXPECT_EQ(setup.amp->scaler().is_enabled(), scaled) << mode;

  const StepOutcome step = train_step(setup, *workload_, batch);
  EXPECT_TRUE(step.stepped) << mode;
  EXPECT_TRUE(std::isfinite(step.loss.item<double>())) << mode;
  int64_t matrices = 0;
  for (const auto& p : setup.model->named_parameters()) {
    if (p.value().dim() != 2) continue;  // matrices: the Linear and embedding weights
    ++matrices;
    EXPECT_EQ(p.value().scalar_type(), low_weights ? low : torch::kFloat) << mode << " " << p.key();
    const auto master = setup.optimizer->master(p.value());
    EXPECT_EQ(master.defined(), masters) << mode << " " << p.key();
    if (master.defined()) {
      EXPECT_EQ(master.scalar_type(), torch::kFloat) << p.key();
    }
  }
  EXPECT_GT(matrices, 0);
  if (scaled) {
    EXPECT_GT(setup.amp->scaler().get_scale(), 1.0) << mode;
  }
  EXPECT_EQ(setup.fp8, mode == "fp8");
  if (mode == "fp8") {
    // d 32: the four Linears of every block; the vocabulary head (Moby
    // Dick's characters, not a multiple of 16) stays out. After one step
    // each one's scales have moved off 1.
    EXPECT_EQ(setup.fp8_layers.size(), 4u * static_cast<size_t>(config_.layers));
    EXPECT_EQ(std::count(setup.fp8_layers.begin(), setup.fp8_layers.end(), "head"), 0);
    for (const auto& name : setup.fp8_layers) {
      auto scaling = ampx::fp8::scaling_of(*setup.model->named_modules()[name]);
      ASSERT_NE(scaling, nullptr) << name;
      EXPECT_NE(scaling->input->scale().item<float>(), 1.0f) << name;
      EXPECT_NE(scaling->grad_output->scale().item<float>(), 1.0f) << name;
      EXPECT_EQ(scaling->input->delayed_state().amax_history().size(0), config_.amax_history);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, ModeTest,
                         testing::Values(ModeCase{"fp32", "bf16"}, ModeCase{"O1", "bf16"},
                                         ModeCase{"fp8", "bf16"}, ModeCase{"O2", "bf16"},
                                         ModeCase{"O3", "bf16"}, ModeCase{"O1", "fp16"},
                                         ModeCase{"O2", "fp16"}, ModeCase{"O3", "fp16"}),
                         case_name);

// The block-scaled modes: O1 with the Linears outside --bf16-layers under
// TE's recipes. gpt of 3 blocks: nvfp4 keeps the first and last blocks and
// the head in bf16 (auto), mxfp8 and fp8-block the head; one step trains.
TEST(BlockModeTest, ConvertsTheLinearsOutsideTheBf16Layers) {
  TempDir tmp("ampx-block-mode");
  write_text_data(tmp.path() / "data", "abcdefgh ", 20000, 3);
  const auto set_up = [&](const std::string& mode, const std::string& bf16_layers) {
    std::vector<std::string> args = {"ampx-train"};
    for (auto& a : tiny_gpt({{"--precision", mode},
                             {"--layers", "3"},
                             {"--bf16-layers", bf16_layers},
                             {"--data-dir", (tmp.path() / "data").string()},
                             {"--out-dir", (tmp.path() / "out").string()},
                             {"--steps", "2"}})) {
      args.push_back(std::move(a));
    }
    std::vector<const char*> argv;
    for (const auto& a : args) argv.push_back(a.c_str());
    TrainConfig config;
    EXPECT_FALSE(parse_command_line(static_cast<int>(argv.size()), argv.data(), config));
    resolve_defaults(config);
    auto workload = make_workload(config);
    ModeSetUp setup =
        set_up_mode(config, *workload, parse_mode(mode, config), torch::Device(torch::kCPU));
    EXPECT_TRUE(setup.fp8) << mode;
    for (const auto& name : setup.fp8_layers) {
      auto scaling = ampx::fp8::scaling_of(*setup.model->named_modules()[name]);
      EXPECT_EQ(scaling->recipe.to_string(), fp8_recipe_of(config, mode).to_string()) << name;
    }
    const StepOutcome step = train_step(setup, *workload, workload->batch(0, torch::kCPU));
    EXPECT_TRUE(step.stepped && std::isfinite(step.loss.item<double>())) << mode;
    return std::make_pair(setup.fp8_layers, setup.bf16_layers);
  };
  const std::vector<std::string> middle = {"blocks.1.attn.qkv", "blocks.1.attn.proj",
                                           "blocks.1.fc", "blocks.1.out"};
  const auto [nvfp4, nvfp4_kept] = set_up("nvfp4", "auto");
  EXPECT_EQ(nvfp4, middle);
  EXPECT_EQ(nvfp4_kept.size(), 9u);  // blocks 0 and 2, the head
  for (const std::string mode : {"mxfp8", "fp8-block"}) {
    const auto [converted, kept] = set_up(mode, "auto");
    EXPECT_EQ(converted.size(), 12u) << mode;
    EXPECT_EQ(kept, std::vector<std::string>{"head"}) << mode;
  }
  const auto [listed, listed_kept] = set_up("mxfp8", "blocks.0,blocks.2,head");
  EXPECT_EQ(listed, middle);
  EXPECT_TRUE(expect_error_contains([&] { (void)set_up("nvfp4", "blocks.7"); },
                                    {"--bf16-layers 'blocks.7' names no Linear of this model"}));
}

}  // namespace
