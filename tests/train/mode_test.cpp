// Each precision mode as ampx-train sets it up and steps it (set_up_mode and
// train_step, the code train_mode runs): the dtype the model's matrix
// products come out in under the mode's forward, the weights' dtype, the
// masters, the loss scale. Issue 19.1: mapping O1 to O0 in the trainer
// trained "O1" in fp32 and every other train test still passed.

#include "cli/config.h"
#include "models.h"
#include "run/trainer.h"
#include "run/workloads.h"
#include "test_support.h"

#include <algorithm>
#include <cmath>

#include <ampx/kernels.h>
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
  {
    // --recompute mlp runs only GELU again (ampx::wide_gelu_linear) where the
    // mode's region computes the MLP's tail as that does: O2's, whose GELU
    // is ampx::mixed_gelu, with wide products (as the train tests run them).
    ASSERT_TRUE(ampx::cpu_products_are_wide(low)) << "the train tests run with wide products";
    auto guard = setup.amp->forward_guard();
    const auto h = torch::randn({4, 8}).to(low), w = torch::randn({2, 8}).to(low);
    EXPECT_EQ(mlp_tail_runs_wide(h, w, torch::randn({2}).to(low)), mode == "O2") << mode;
    EXPECT_FALSE(mlp_tail_runs_wide(h, w, torch::randn({2}))) << mode << ": a float32 bias";
  }

  const StepOutcome step = train_step(setup, *workload_, batch);
  EXPECT_TRUE(step.stepped) << mode;
  EXPECT_TRUE(std::isfinite(step.loss.item<double>())) << mode;
  int64_t matrices = 0;
  for (const auto& p : setup.model->named_parameters()) {
    if (p.value().dim() != 2) continue;  // matrices: the Linear and embedding weights
    ++matrices;
    EXPECT_EQ(p.value().scalar_type(), low_weights ? low : torch::kFloat) << mode << " " << p.key();
    const auto master =
        dynamic_cast<ampx::optim::MixedPrecisionOptimizer&>(*setup.optimizer).master(p.value());
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
    const TrainConfig config =
        resolved_config(tiny_gpt({{"--precision", mode},
                                  {"--layers", "3"},
                                  {"--bf16-layers", bf16_layers},
                                  {"--data-dir", (tmp.path() / "data").string()},
                                  {"--out-dir", (tmp.path() / "out").string()},
                                  {"--steps", "2"}}));
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

// The config of tiny_gpt(flags) on the data in `tmp` (its errors thrown).
TrainConfig block_config(const TempDir& tmp,
                         std::vector<std::pair<std::string, std::string>> flags) {
  flags.insert(flags.begin(), {{"--data-dir", (tmp.path() / "data").string()},
                               {"--out-dir", (tmp.path() / "out").string()},
                               {"--bf16-layers", "none"}});
  return resolved_config(tiny_gpt(flags));
}

// --fp8-tail: in the tail an FP8 mode's Linears run as O1's, forward and
// backward, bit for bit (the FP8 region closed); the run's last steps train
// there from the step the share places (0.4: step 2 of 4, and of 3), and a
// run resumed past that step (or with none left) enters it again, ending
// with the uninterrupted run's weights and evaluation; another share, or
// one that covers every step, is refused by name.
TEST(BlockModeTest, Fp8TailTrainsTheLastStepsAsO1AndAResumeEntersItAgain) {
  TempDir tmp("ampx-fp8-tail");
  write_text_data(tmp.path() / "data", "abcdefgh ", 20000, 3);
  const torch::Device cpu(torch::kCPU);
  const TrainConfig config = block_config(tmp, {{"--precision", "nvfp4"}});
  auto workload = make_workload(config);
  const Batch batch = workload->batch(0, cpu);
  const auto step_of = [&](const std::string& mode, bool tail) {
    ModeSetUp setup = set_up_mode(config, *workload, parse_mode(mode, config), cpu);
    if (tail) enter_tail(setup);
    const StepOutcome out = train_step(setup, *workload, batch);
    std::vector<torch::Tensor> grads;
    for (const auto& p : setup.model->parameters()) grads.push_back(p.grad().clone());
    return std::make_pair(out.loss.item<double>(), grads);
  };
  const auto [o1_loss, o1_grads] = step_of("O1", false);
  const auto [tail_loss, tail_grads] = step_of("nvfp4", true);
  const auto [fp4_loss, fp4_grads] = step_of("nvfp4", false);
  EXPECT_EQ(tail_loss, o1_loss);
  EXPECT_NE(fp4_loss, o1_loss);
  ASSERT_EQ(tail_grads.size(), o1_grads.size());
  bool fp4_differs = false;
  for (size_t i = 0; i < o1_grads.size(); ++i) {
    EXPECT_TRUE(torch::equal(tail_grads[i], o1_grads[i])) << "parameter " << i;
    fp4_differs = fp4_differs || !torch::equal(fp4_grads[i], o1_grads[i]);
  }
  EXPECT_TRUE(fp4_differs);

  const auto run = [&](const std::string& name, const std::string& tail, int64_t steps,
                       bool resume) {
    TrainConfig c = block_config(tmp, {{"--precision", "nvfp4"},
                                       {"--fp8-tail", tail},
                                       {"--steps", std::to_string(steps)},
                                       {"--save-every", "3"},
                                       {"--checkpoint-dir", (tmp.path() / name / "ckpt").string()},
                                       {"--out-dir", (tmp.path() / name).string()}});
    c.resume = resume;
    return train_mode(c, *workload, "nvfp4");
  };
  const RunResult whole = run("whole", "40%", 4, false);
  const RunResult none = run("none", "0", 4, false);
  EXPECT_EQ(whole.tail_start, 2);
  EXPECT_EQ(none.tail_start, -1);
  ASSERT_EQ(whole.losses.size(), 4u);
  ASSERT_EQ(none.losses.size(), 4u);
  EXPECT_EQ(whole.losses[1], none.losses[1]);  // NVFP4 before the tail
  EXPECT_NE(whole.losses[2], none.losses[2]);  // the same weights, in bf16
  EXPECT_NE(whole.weights_checksum, none.weights_checksum);
  const RunResult first = run("parts", "0.4", 3, false);  // steps 0-2, checkpoint after 2
  EXPECT_EQ(first.tail_start, 2);
  const RunResult resumed = run("parts", "0.4", 4, true);  // step 3, in the tail again
  EXPECT_EQ(resumed.weights_checksum, whole.weights_checksum);
  EXPECT_TRUE(expect_error_contains([&] { (void)run("parts", "0.2", 4, true); },
                                    {"fp8_tail=0.4, this run has fp8_tail=0.2"}));
  // Resumed with no step left: evaluated in the tail, as the run that wrote it was.
  const RunResult again = run("whole", "40%", 4, true);
  EXPECT_EQ(again.losses, whole.losses);  // the checkpoint's, none trained
  EXPECT_EQ(again.eval.loss, whole.eval.loss);
  // A share that leaves no FP8 step is refused.
  EXPECT_TRUE(expect_error_contains([&] { (void)run("short", "50%", 1, false); },
                                    {"--fp8-tail 50% covers every one of the run's 1 steps"}));
  // A share that rounds to no step trains without a tail, and says so.
  testing::internal::CaptureStdout();
  const RunResult rounded = run("rounded", "10%", 4, false);
  const std::string said = testing::internal::GetCapturedStdout();
  EXPECT_EQ(rounded.tail_start, -1);
  EXPECT_EQ(rounded.losses, none.losses);
  EXPECT_TRUE(contains(said, {"[nvfp4] --fp8-tail 10% of 4 steps rounds to no step"})) << said;
  EXPECT_NO_THROW((void)block_config(tmp, {{"--plan-tail", "0"}}));
  // The flag names itself: for the FP8 modes only (a share of 0 is no tail
  // in any mode), a share in [0, 1).
  EXPECT_TRUE(contains(error_text([&] { (void)block_config(tmp, {{"--fp8-tail", "10%"}}); }),
                       {"--fp8-tail 10% is for the FP8 modes"}));
  EXPECT_NO_THROW((void)block_config(tmp, {{"--fp8-tail", "0%"}}));
  EXPECT_TRUE(contains(error_text([&] {
                         (void)block_config(tmp, {{"--precision", "nvfp4"}, {"--fp8-tail", "1"}});
                       }),
                       {"--fp8-tail '1' is not a share of the steps in [0, 1)"}));
}

}  // namespace
