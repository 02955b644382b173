// GradScaler's opt-in diagnostics on real overflows: which gradients were
// inf/NaN on a skipped step, the "loss scale collapsed" warning, and module
// buffers kept as they were before a skipped step.

#include "ampx/grad_scaler.h"

#include "../test_util.h"
#include "ampx/detail/compat.h"
#include "ampx/optim.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

using ampx::GradScaler;
using ampx::GradScalerOptions;
using ampx::test::error_text;
using ::testing::HasSubstr;
using ::testing::StartsWith;

using ampx::test::kInf;
using ampx::test::WarningCapture;
const double kScale2p127 = std::ldexp(1.0, 127);  // 1.70141e+38: x4 overflows float32

/// fc1 (8 -> 16) then fc2 (16 -> 1), set up so that with a scale of 2^127
/// only fc2's gradients overflow: h = relu(fc1(1)) = 0.9 everywhere, so
/// d(4 rows' sum)/d fc2.weight = 3.6 * scale and d/d fc2.bias = 4 * scale,
/// while fc1's = 4e-6 * scale (fc2.weight = 1e-6).
ampx::test::Mlp overflowing_mlp() {
  ampx::test::Mlp net(16);
  torch::NoGradGuard no_grad;
  net->fc1->weight.fill_(0.1);
  net->fc1->bias.fill_(0.1);
  net->fc2->weight.fill_(1e-6);
  net->fc2->bias.zero_();
  return net;
}

/// One iteration on 4 rows of ones; whether the optimizer stepped.
bool train_step(GradScaler& scaler, ampx::test::Mlp& net, torch::optim::Optimizer& opt,
                bool unscale_first) {
  opt.zero_grad();
  scaler.scale(net->forward(torch::ones({4, 8})).sum()).backward();
  if (unscale_first) scaler.unscale_(opt);
  const bool stepped = scaler.step(opt).stepped();
  scaler.update();
  return stepped;
}

// Iteration 0 (scale 2^127): fc2.weight and fc2.bias overflow; iteration 1
// (2^126): fc2.bias only (4 * 2^126 = 2^128); iteration 2 (2^125): none.
void expect_fc2_explained(GradScaler& scaler, const WarningCapture& warnings) {
  ASSERT_EQ(scaler.skipped_steps().size(), 2u);
  const auto& first = scaler.skipped_steps()[0];
  EXPECT_EQ(first.iteration, 0);
  EXPECT_EQ(first.scale, kScale2p127);
  EXPECT_EQ(first.num_grads, 4);
  ASSERT_EQ(first.grads.size(), 2u);
  EXPECT_EQ(first.grads[0].name, "fc2.weight");
  EXPECT_EQ(first.grads[0].sizes, (std::vector<int64_t>{1, 16}));
  EXPECT_EQ(first.grads[0].dtype, at::kFloat);
  EXPECT_EQ(first.grads[0].non_finite, 16);
  EXPECT_EQ(first.grads[1].name, "fc2.bias");
  EXPECT_EQ(first.grads[1].non_finite, 1);
  const auto& second = scaler.skipped_steps()[1];
  EXPECT_EQ(second.iteration, 1);
  EXPECT_EQ(second.scale, kScale2p127 / 2);
  ASSERT_EQ(second.grads.size(), 1u);
  EXPECT_EQ(second.grads[0].name, "fc2.bias");
  EXPECT_EQ(second.grads[0].non_finite, 1);
  ASSERT_TRUE(scaler.last_skipped_step().has_value());
  EXPECT_EQ(scaler.last_skipped_step()->iteration, 1);

  ASSERT_EQ(warnings.messages.size(), 2u);
  EXPECT_EQ(warnings.messages[0],
            "GradScaler: skipped step at iteration 0 (scale 1.70141e+38): 2 of 4 gradients hold "
            "inf/NaN: fc2.weight [1, 16] Float (16 non-finite), fc2.bias [1] Float (1 "
            "non-finite)");
  EXPECT_EQ(warnings.messages[1], "GradScaler: " + second.to_string());
}

TEST(GradScalerExplainTest, NamesExactlyTheOverflowingLayerAfterUnscale) {
  auto net = overflowing_mlp();
  torch::optim::SGD opt(net->parameters(), 1e-3);
  GradScaler scaler(GradScalerOptions().init_scale(kScale2p127).explain_skipped_steps(true));
  scaler.name_parameters(net->named_parameters());
  WarningCapture warnings;
  EXPECT_FALSE(train_step(scaler, net, opt, /*unscale_first=*/true));
  EXPECT_FALSE(train_step(scaler, net, opt, /*unscale_first=*/true));
  EXPECT_TRUE(train_step(scaler, net, opt, /*unscale_first=*/true));
  expect_fc2_explained(scaler, warnings);
}

TEST(GradScalerExplainTest, NamesExactlyTheOverflowingLayerThroughAScalerAwareOptimizer) {
  // step_scaled() gets still-scaled gradients: inf stays inf.
  auto net = overflowing_mlp();
  ampx::optim::SGD opt(net->parameters(), ampx::optim::SGDOptions(1e-3));
  GradScaler scaler(GradScalerOptions().init_scale(kScale2p127).explain_skipped_steps(true));
  scaler.name_parameters(net->named_parameters());
  WarningCapture warnings;
  EXPECT_FALSE(train_step(scaler, net, opt, /*unscale_first=*/false));
  EXPECT_FALSE(train_step(scaler, net, opt, /*unscale_first=*/false));
  EXPECT_TRUE(train_step(scaler, net, opt, /*unscale_first=*/false));
  expect_fc2_explained(scaler, warnings);
}

TEST(GradScalerExplainTest, UnnamedParametersAreTheOptimizersIndices) {
  auto net = overflowing_mlp();
  torch::optim::SGD opt(net->parameters(), 1e-3);  // fc1.weight, fc1.bias, fc2.weight, fc2.bias
  GradScaler scaler(GradScalerOptions().init_scale(kScale2p127).explain_skipped_steps(true));
  WarningCapture warnings;
  EXPECT_FALSE(train_step(scaler, net, opt, /*unscale_first=*/false));
  ASSERT_TRUE(scaler.last_skipped_step().has_value());
  const auto grads = scaler.last_skipped_step()->grads;
  ASSERT_EQ(grads.size(), 2u);
  EXPECT_EQ(grads[0].name, "param_groups[0].params[2]");
  EXPECT_EQ(grads[1].name, "param_groups[0].params[3]");
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_THAT(warnings.messages[0],
              HasSubstr("param_groups[0].params[2] [1, 16] Float (16 non-finite), "
                        "param_groups[0].params[3] [1] Float (1 non-finite)"));
}

TEST(GradScalerExplainTest, ListsEightNamesThenHowManyMore) {
  std::vector<torch::Tensor> params;
  for (int i = 0; i < 10; ++i) params.push_back(torch::ones({2}).requires_grad_());
  torch::optim::SGD opt(params, 1e-3);
  GradScaler scaler(GradScalerOptions().init_scale(kScale2p127).explain_skipped_steps(true));
  WarningCapture warnings;
  auto loss = torch::zeros({});
  for (const auto& p : params) loss = loss + (4 * p).sum();  // d/dp = 4 * 2^127 = inf
  scaler.scale(loss).backward();
  EXPECT_FALSE(scaler.step(opt).stepped());
  ASSERT_EQ(scaler.last_skipped_step()->grads.size(), 10u);
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_THAT(warnings.messages[0],
              StartsWith("GradScaler: skipped step at iteration 0 (scale 1.70141e+38): 10 of 10 "
                         "gradients hold inf/NaN: param_groups[0].params[0] [2] Float (2 "
                         "non-finite), "));
  EXPECT_THAT(warnings.messages[0],
              HasSubstr("param_groups[0].params[7] [2] Float (2 non-finite), and 2 more"));
  EXPECT_THAT(warnings.messages[0], ::testing::Not(HasSubstr("params[8]")));
}

TEST(GradScalerExplainTest, OffByDefaultRecordsAndWarnsNothing) {
  auto net = overflowing_mlp();
  torch::optim::SGD opt(net->parameters(), 1e-3);
  GradScaler scaler(GradScalerOptions().init_scale(kScale2p127));
  scaler.name_parameters(net->named_parameters());
  WarningCapture warnings;
  EXPECT_FALSE(train_step(scaler, net, opt, /*unscale_first=*/false));
  EXPECT_FALSE(train_step(scaler, net, opt, /*unscale_first=*/true));
  EXPECT_TRUE(scaler.skipped_steps().empty());
  EXPECT_FALSE(scaler.last_skipped_step().has_value());
  EXPECT_TRUE(warnings.messages.empty());
}

TEST(GradScalerExplainTest, HistoryKeepsTheLastSixteen) {
  torch::Tensor w = torch::ones({3}).requires_grad_();
  torch::optim::SGD opt({w}, 1e-3);
  GradScaler scaler(GradScalerOptions().explain_skipped_steps(true));
  WarningCapture warnings;
  for (int i = 0; i < 20; ++i) {
    opt.zero_grad();
    scaler.scale((w * kInf).sum()).backward();
    EXPECT_FALSE(scaler.step(opt).stepped());
    scaler.update();
  }
  ASSERT_EQ(scaler.skipped_steps().size(), GradScaler::kSkippedStepHistory);
  EXPECT_EQ(scaler.skipped_steps().front().iteration, 4);
  EXPECT_EQ(scaler.skipped_steps().back().iteration, 19);
  EXPECT_EQ(warnings.messages.size(), 20u);
}

TEST(GradScalerExplainTest, CollapseWarningStepsIsChecked) {
  EXPECT_EQ(error_text([] { GradScaler s(GradScalerOptions().collapse_warning_steps(-1)); }),
            "GradScaler: collapse_warning_steps must be >= 0, got -1");
}

/// `overflows[i]`: whether iteration i's gradients are inf (inf in the
/// forward, whatever the scale). Returns whether scale_collapsed() held
/// after each update().
std::vector<bool> run_overflow_pattern(GradScaler& scaler, const std::vector<bool>& overflows) {
  torch::Tensor w = torch::ones({3}).requires_grad_();
  torch::optim::SGD opt({w}, 1e-3);
  std::vector<bool> collapsed;
  for (const bool overflow : overflows) {
    opt.zero_grad();
    scaler.scale((w * (overflow ? kInf : 1.f)).sum()).backward();
    scaler.step(opt);
    scaler.update();
    collapsed.push_back(scaler.scale_collapsed());
  }
  return collapsed;
}

TEST(GradScalerExplainTest, WarnsOnceWhenTheScaleKeepsFalling) {
  GradScaler scaler(GradScalerOptions().init_scale(1024).collapse_warning_steps(5));
  WarningCapture warnings;
  torch::Tensor w = torch::ones({3}).requires_grad_();
  torch::optim::SGD opt({w}, 1e-3);
  for (int i = 1; i <= 10; ++i) {
    opt.zero_grad();
    scaler.scale((w * kInf).sum()).backward();
    scaler.step(opt);
    scaler.update();
    // Not after 4 updates, exactly after the 5th, and never again.
    EXPECT_EQ(warnings.messages.size(), i < 5 ? 0u : 1u) << "after update " << i;
    EXPECT_EQ(scaler.scale_collapsed(), i >= 5) << "after update " << i;
  }
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_THAT(warnings.messages[0],
              StartsWith("loss scale collapsed: the last 5 update() calls all found inf/NaN "
                         "gradients and skipped their steps; the scale went 1024 -> 512 -> 256 "
                         "-> 128 -> 64 -> 32. "));
  EXPECT_THAT(warnings.messages[0], HasSubstr("ampx::debug::NonFiniteGuard"));
}

TEST(GradScalerExplainTest, WarnsWhenTheScaleSitsAtMinScale) {
  GradScaler scaler(
      GradScalerOptions().init_scale(1024).min_scale(256.0).collapse_warning_steps(4));
  WarningCapture warnings;
  const auto collapsed = run_overflow_pattern(scaler, std::vector<bool>(6, true));
  EXPECT_EQ(collapsed, (std::vector<bool>{false, false, false, true, true, true}));
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_THAT(warnings.messages[0],
              StartsWith("loss scale collapsed: the last 4 update() calls all found inf/NaN "
                         "gradients and skipped their steps; the scale went 1024 -> 512 -> 256 "
                         "-> 256 -> 256 (min_scale). "));
}

TEST(GradScalerExplainTest, LongHistoriesShowTheirLastScales) {
  GradScaler scaler(GradScalerOptions().init_scale(std::ldexp(1.0, 30)).collapse_warning_steps(20));
  WarningCapture warnings;
  run_overflow_pattern(scaler, std::vector<bool>(20, true));
  ASSERT_EQ(warnings.messages.size(), 1u);
  // 2^30 halved 20 times: the last 17 of 21 values, 2^26 .. 2^10.
  EXPECT_THAT(warnings.messages[0],
              HasSubstr("the scale went ... -> 6.71089e+07 -> 3.35544e+07 -> "));
  EXPECT_THAT(warnings.messages[0], HasSubstr(" -> 2048 -> 1024. "));
}

TEST(GradScalerExplainTest, NoCollapseWarningWhenOffOrWhenTheScaleRecovers) {
  {
    GradScaler scaler(GradScalerOptions().init_scale(1024));  // collapse_warning_steps 0
    WarningCapture warnings;
    const auto collapsed = run_overflow_pattern(scaler, std::vector<bool>(20, true));
    EXPECT_EQ(collapsed, std::vector<bool>(20, false));
    EXPECT_TRUE(warnings.messages.empty());
  }
  {
    // Four overflows, a clean step, four overflows, a clean step...
    GradScaler scaler(GradScalerOptions().init_scale(1024).collapse_warning_steps(5));
    WarningCapture warnings;
    std::vector<bool> pattern;
    for (int i = 0; i < 4; ++i) pattern.insert(pattern.end(), {true, true, true, true, false});
    const auto collapsed = run_overflow_pattern(scaler, pattern);
    EXPECT_EQ(collapsed, std::vector<bool>(pattern.size(), false));
    EXPECT_TRUE(warnings.messages.empty());
  }
}

// ---------------------------------------------------------------- buffers

/// BatchNorm1d(4) then Linear(4, 1), fp32.
struct BnNetImpl : torch::nn::Module {
  BnNetImpl() {
    bn = register_module("bn", torch::nn::BatchNorm1d(4));
    fc = register_module("fc", torch::nn::Linear(4, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc(bn(x)); }
  torch::nn::BatchNorm1d bn{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(BnNet);

torch::Tensor normal_batch() {
  auto g = at::detail::createCPUGenerator(7);
  return at::randn({16, 4}, g);
}

/// Huge inputs: the batch variance (~1e40) is inf in float32, so the forward
/// poisons running_var; and with a scale of 2^127, d(8 * sum)/d fc.bias =
/// 16 * 8 * 2^127 overflows, so the step is skipped.
torch::Tensor poisoning_batch() {
  return normal_batch() * 1e20;
}

/// One iteration; `loss_factor` times the output's sum; whether it stepped.
bool bn_step(GradScaler& scaler, BnNet& net, torch::optim::Optimizer& opt, const torch::Tensor& x,
             double loss_factor) {
  opt.zero_grad();
  scaler.scale(net->forward(x).sum() * loss_factor).backward();
  const bool stepped = scaler.step(opt).stepped();
  scaler.update();
  return stepped;
}

TEST(GradScalerBuffersTest, SkippedStepPoisonsRunningStatsWithoutProtection) {
  BnNet net;
  torch::optim::SGD opt(net->parameters(), 1e-3);
  GradScaler scaler(GradScalerOptions().init_scale(kScale2p127));
  const auto before = ampx::test::snapshot(net->buffers());
  EXPECT_FALSE(bn_step(scaler, net, opt, poisoning_batch(), 8.0));
  EXPECT_TRUE(torch::isinf(net->bn->running_var).any().item<bool>());
  EXPECT_FALSE(torch::equal(net->bn->running_mean, before[0]));
  EXPECT_EQ(net->bn->num_batches_tracked.item<int64_t>(), 1);
}

TEST(GradScalerBuffersTest, ProtectedBuffersComeBackBitwiseAfterASkippedStep) {
  BnNet net;
  torch::optim::SGD opt(net->parameters(), 1e-3);
  GradScaler scaler(GradScalerOptions().init_scale(kScale2p127));
  // One clean step first, so that the stats are not just their initial values.
  {
    torch::NoGradGuard no_grad;
    net->forward(normal_batch() + 3);
  }
  scaler.protect_buffers(*net);
  const auto before = ampx::test::snapshot(net->buffers());  // mean, var, count
  ASSERT_EQ(before.size(), 3u);
  EXPECT_EQ(before[2].item<int64_t>(), 1);

  EXPECT_FALSE(bn_step(scaler, net, opt, poisoning_batch(), 8.0));
  EXPECT_TRUE(ampx::test::same_bits(before, net->buffers()));

  // A step that is not skipped updates them as BatchNorm does, once.
  BnNet reference;
  ampx::test::copy_params(*net, *reference);
  {
    torch::NoGradGuard no_grad;
    reference->forward(normal_batch() + 3);
    reference->forward(normal_batch());
  }
  EXPECT_TRUE(bn_step(scaler, net, opt, normal_batch(), std::ldexp(1.0, -100)));
  EXPECT_EQ(net->bn->num_batches_tracked.item<int64_t>(), 2);
  EXPECT_TRUE(ampx::test::same_bits(reference->buffers(), net->buffers()));
  EXPECT_FALSE(torch::equal(net->bn->running_mean, before[0]));

  // And the snapshot follows: the next skipped step returns to these.
  const auto after_clean = ampx::test::snapshot(net->buffers());
  EXPECT_FALSE(bn_step(scaler, net, opt, poisoning_batch(), std::ldexp(1.0, 30)));
  EXPECT_TRUE(ampx::test::same_bits(after_clean, net->buffers()));
}

TEST(GradScalerBuffersTest, DisabledScalerLeavesBuffersToBatchNorm) {
  BnNet net;
  torch::optim::SGD opt(net->parameters(), 1e-3);
  GradScaler scaler(GradScalerOptions().enabled(false));
  scaler.protect_buffers(*net);
  const auto before = ampx::test::snapshot(net->buffers());
  EXPECT_TRUE(bn_step(scaler, net, opt, normal_batch(), 1.0));
  EXPECT_FALSE(torch::equal(net->bn->running_mean, before[0]));
  EXPECT_EQ(net->bn->num_batches_tracked.item<int64_t>(), 1);
}

TEST(GradScalerBuffersTest, CudaBuffersAreRestoredOnTheDevice) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
  BnNet net;
  net->to(torch::kCUDA);
  torch::optim::SGD opt(net->parameters(), 1e-3);
  GradScaler scaler(GradScalerOptions().init_scale(kScale2p127));
  scaler.protect_buffers(*net);
  const auto before = ampx::test::snapshot(net->buffers());
  EXPECT_FALSE(bn_step(scaler, net, opt, poisoning_batch().cuda(), 8.0));
  EXPECT_TRUE(ampx::test::same_bits(before, net->buffers()));
  EXPECT_TRUE(bn_step(scaler, net, opt, normal_batch().cuda(), std::ldexp(1.0, -100)));
  EXPECT_EQ(net->bn->num_batches_tracked.item<int64_t>(), 1);
}

}  // namespace
