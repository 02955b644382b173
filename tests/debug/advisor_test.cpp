// The precision advisor, checked against reality: what it predicts from an
// fp32 run's statistics happens when the same model trains in fp16 (CPU
// fp16 autocast: the 2.x leg), and what it calls safe trains cleanly.

#include "ampx/debug/advisor.h"
#include "ampx/debug/nonfinite.h"
#include "ampx/debug/range_stats.h"
#include "ampx/debug/scope.h"

#include "../test_util.h"
#include "ampx/autocast.h"
#include "ampx/grad_scaler.h"

#include <cmath>

namespace ampx {
namespace debug {
namespace {

using ::testing::HasSubstr;

// fc1's weights are multiplied by `up` and fc2's by `down`, so that a model
// can carry large activations between them and still produce small outputs.
struct ScaledMlpImpl : torch::nn::Module {
  ScaledMlpImpl(double up, double down) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 1));
    torch::NoGradGuard no_grad;
    fc1->weight.mul_(up);
    fc1->bias.mul_(up);
    fc2->weight.mul_(down);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    ModuleScopeGuard scope(*this);
    return fc2->forward(torch::tanh(fc1->forward(x)));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(ScaledMlp);

// `steps` fp32 steps of SGD with the loss multiplied by `loss_factor`.
RangeStats fp32_statistics(ScaledMlp& net, int steps, double loss_factor) {
  torch::optim::SGD opt(net->parameters(), 1e-6);
  RangeStatsCollector collector;
  for (int step = 0; step < steps; ++step) {
    const auto b = test::make_batch(step, 64);
    opt.zero_grad();
    (torch::mse_loss(net->forward(b.x), b.y) * loss_factor).backward();
    opt.step();
  }
  return collector.stats();
}

bool lists(const std::vector<ScopeFinding>& findings, const std::string& scope, Direction d) {
  for (const auto& f : findings) {
    if (f.scope == scope && f.direction == d) return true;
  }
  return false;
}

TEST(AdvisorTest, PredictsTheFp16ActivationOverflowThatFp16TrainingThenHits) {
  torch::manual_seed(0);
  ScaledMlp net(1e5,
                1.0);  // fc1's activations reach ~2e5 (its weights fit fp16); tanh shrinks them
  name_modules(*net, "mlp");
  const auto advice = advise(fp32_statistics(net, 2, 1.0));
  const auto& fp16 = advice.at(Format::kFloat16);
  EXPECT_EQ(fp16.verdict, Verdict::kOverflows) << advice.to_markdown();
  ASSERT_FALSE(fp16.overflows.empty());
  EXPECT_TRUE(lists(fp16.overflows, "mlp.fc1", Direction::kForward)) << advice.to_markdown();
  EXPECT_FALSE(lists(fp16.overflows, "mlp.fc2", Direction::kForward)) << advice.to_markdown();
  EXPECT_GT(fp16.overflows[0].abs_max, 65504.0);
  EXPECT_EQ(advice.verdict(Format::kBFloat16), Verdict::kSafe) << advice.to_markdown();
  EXPECT_EQ(advice.recommended, Format::kBFloat16);
  EXPECT_THAT(advice.to_markdown(), HasSubstr("float16: "));
  EXPECT_THAT(advice.to_markdown(), HasSubstr("mlp.fc1 max "));
  EXPECT_THAT(advice.to_json(), HasSubstr("\"verdict\": \"overflows\""));

  if (!test::cpu_fp16_autocast()) {
    clear_module_names();
    GTEST_SKIP() << "the prediction holds; checking it in fp16 needs float16 CPU autocast (2.x)";
  }
  // Reality: the first non-finite value of an fp16 forward is fc1's.
  try {
    NonFiniteGuard guard;
    AutocastGuard autocast(torch::kCPU, torch::kHalf);
    (void)net->forward(test::make_batch(9, 64).x);
    ADD_FAILURE() << "fp16 forward stayed finite";
  } catch (const NonFiniteError& e) {
    EXPECT_EQ(e.report().scope, "mlp.fc1") << e.what();
    EXPECT_EQ(e.report().direction, Direction::kForward);
    EXPECT_EQ(e.report().dtype, torch::kHalf);
  }
  clear_module_names();
}

TEST(AdvisorTest, ChoosesTheLossScaleThatRescuesTinyFp16Gradients) {
  // A loss scaled by 2^-28: fp32 gradients around 1e-9 and smaller, most of
  // which fp16 flushes to zero at scale 1.
  torch::manual_seed(0);
  ScaledMlp net(1.0, 1.0);
  name_modules(*net, "mlp");
  const double tiny = std::ldexp(1.0, -28);
  const auto stats = fp32_statistics(net, 2, tiny);
  const auto grads = stats.merged("mlp.fc1", Direction::kBackward);
  EXPECT_GT(grads.fraction_to_zero(Format::kFloat16), 0.01);  // at scale 1
  const auto advice = advise(stats);
  const auto& fp16 = advice.at(Format::kFloat16);
  EXPECT_EQ(fp16.verdict, Verdict::kNeedsScaling) << advice.to_markdown();
  EXPECT_GE(fp16.loss_scale, std::ldexp(1.0, 20));
  EXPECT_TRUE(fp16.underflows.empty()) << advice.to_markdown();
  EXPECT_EQ(advice.verdict(Format::kBFloat16), Verdict::kSafe) << advice.to_markdown();

  if (!test::cpu_fp16_autocast()) {
    clear_module_names();
    GTEST_SKIP() << "the prediction holds; checking it in fp16 needs float16 CPU autocast (2.x)";
  }
  // Reality: at the advisor's scale every step is clean (no overflow, no
  // skip) and fc1's gradients survive; at scale 1 most of them are zero.
  auto zero_fraction = [&](double scale) {
    torch::manual_seed(1);
    ScaledMlp fresh(1.0, 1.0);
    GradScaler scaler(GradScalerOptions().init_scale(scale).growth_interval(1000000));
    torch::optim::SGD opt(fresh->parameters(), 0.0);
    NonFiniteGuard guard;
    double zeros = 0;
    for (int step = 0; step < 5; ++step) {
      const auto b = test::make_batch(step, 64);
      fresh->zero_grad();
      torch::Tensor loss;
      {
        AutocastGuard autocast(torch::kCPU, torch::kHalf);
        loss = torch::mse_loss(fresh->forward(b.x).to(torch::kFloat), b.y) * tiny;
      }
      scaler.scale(loss).backward();
      zeros = (fresh->fc1->weight.grad() == 0).to(torch::kDouble).mean().item<double>();
      scaler.step(opt);
      scaler.update();
      EXPECT_EQ(scaler.get_scale(), scale) << "a step overflowed at scale " << scale;
    }
    return zeros;
  };
  EXPECT_LT(zero_fraction(fp16.loss_scale), 0.01);
  EXPECT_GT(zero_fraction(1.0), 0.5);
  clear_module_names();
}

TEST(AdvisorTest, RejectsBadOptions) {
  RangeStats empty;
  EXPECT_THROW(advise(empty, AdvisorOptions().underflow_tolerance(1.5)), c10::Error);
  EXPECT_THROW(advise(empty, AdvisorOptions().headroom(0.5)), c10::Error);
  EXPECT_EQ(advise(empty).recommended, Format::kBFloat16);
}

}  // namespace
}  // namespace debug
}  // namespace ampx
