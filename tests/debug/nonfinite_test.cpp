// NonFiniteGuard and named scopes: planted faults, and the guard must name
// the op, the direction and the scope exactly.

#include "ampx/debug/nonfinite.h"
#include "ampx/debug/range_stats.h"
#include "ampx/debug/scope.h"

#include "../test_util.h"
#include "ampx/amp.h"
#include "ampx/autocast.h"
#include "ampx/optim.h"

#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cmath>
#include <limits>

namespace ampx {
namespace debug {
namespace {

using ::testing::HasSubstr;

// Runs `f`, which must throw NonFiniteError, and returns its report.
template <typename F>
NonFiniteReport expect_report(F&& f) {
  try {
    f();
  } catch (const NonFiniteError& e) {
    return e.report();
  }
  ADD_FAILURE() << "no NonFiniteError";
  return {};
}

// Two named layers; fc2's weights are made positive and multiplied by
// `scale`: with positive inputs its outputs grow about 10x `scale`.
struct TwoLayerImpl : torch::nn::Module {
  explicit TwoLayerImpl(double scale = 1.0) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
    torch::NoGradGuard no_grad;
    if (scale != 1.0) fc2->weight.abs_().mul_(scale);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    ModuleScopeGuard scope(*this);
    return fc2->forward(torch::relu(fc1->forward(x)));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(TwoLayer);

TEST(ScopeTest, InnermostScopeAndModulePaths) {
  EXPECT_EQ(current_scope(), "");
  {
    NamedScopeGuard outer("outer");
    EXPECT_EQ(current_scope(), "outer");
    {
      NamedScopeGuard inner("inner");
      EXPECT_EQ(current_scope(), "inner");
    }
    EXPECT_EQ(current_scope(), "outer");
  }
  EXPECT_EQ(current_scope(), "");

  auto seq = torch::nn::Sequential(TwoLayer(), TwoLayer());
  auto* second = seq[1]->as<TwoLayerImpl>();
  EXPECT_EQ(module_path(*second->fc1), second->fc1->name());  // never named: class name
  name_modules(*seq, "net");
  EXPECT_EQ(module_path(*second->fc1), "net.1.fc1");
  EXPECT_EQ(module_path(*seq), "net");
  {
    ModuleScopeGuard scope(*second);
    EXPECT_EQ(current_scope(), "net.1");
  }
  clear_module_names();
  EXPECT_EQ(module_path(*second->fc1), second->fc1->name());
}

TEST(NonFiniteGuardTest, LogOfNegativeNamesOpDirectionScopeAndElement) {
  auto x = torch::tensor({1.0f, 2.0f, -3.0f, 4.0f, -5.0f, 6.0f}).view({2, 3});
  const auto r = expect_report([&] {
    NonFiniteGuard guard(NonFiniteOptions().step(41));
    NamedScopeGuard scope("head");
    (void)torch::log(x);
  });
  EXPECT_EQ(r.op, "aten::log");
  EXPECT_EQ(r.direction, Direction::kForward);
  EXPECT_EQ(r.scope, "head");
  EXPECT_EQ(r.step, 41);
  EXPECT_EQ(r.nan_count, 2);
  EXPECT_EQ(r.inf_count, 0);
  EXPECT_EQ(r.numel, 6);
  EXPECT_EQ(r.first_index, (std::vector<int64_t>{0, 2}));
  EXPECT_TRUE(std::isnan(r.first_value));
  EXPECT_FALSE(r.propagated());
  ASSERT_EQ(r.inputs.size(), 1u);
  EXPECT_EQ(r.inputs[0].name, "self");
  EXPECT_EQ(r.inputs[0].abs_max, 6.0);
  EXPECT_EQ(r.inputs[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_THAT(r.message(),
              HasSubstr("non-finite values from aten::log in forward, scope 'head', step 41"));
  EXPECT_THAT(r.message(), HasSubstr("this op created the non-finite values"));
}

// A guard that lives across steps quotes the step it was last given; a
// guard given none, -1 (there is no process-wide step).
TEST(NonFiniteGuardTest, ReportsQuoteTheGuardsStep) {
  const auto x = torch::tensor({-1.0f});
  NonFiniteGuard guard(NonFiniteOptions().action(NonFiniteAction::kWarn));
  (void)torch::log(x);
  guard.set_step(7);
  (void)torch::log(x);
  ASSERT_EQ(guard.reports().size(), 2u);
  EXPECT_EQ(guard.reports()[0].step, -1);
  EXPECT_EQ(guard.reports()[1].step, 7);
  const auto unstepped = expect_report([&] {
    NonFiniteGuard guard_without_step;
    (void)torch::log(x);
  });
  const auto own = expect_report([&] {
    NonFiniteGuard stepped(NonFiniteOptions().step(3));
    (void)torch::log(x);
  });
  EXPECT_EQ(unstepped.step, -1);
  EXPECT_EQ(own.step, 3);
}

TEST(NonFiniteGuardTest, Fp32OverflowInANamedLayerNamesTheLayerFromItsParameters) {
  torch::manual_seed(0);
  TwoLayer net(1e38);  // fc2's activations pass fp32's 3.4e38
  name_modules(*net);
  const auto x = torch::randn({4, 8}) * 10;
  const auto r = expect_report([&] {
    NonFiniteGuard guard;
    (void)net->forward(x);
  });
  EXPECT_EQ(r.direction, Direction::kForward);
  EXPECT_EQ(r.scope, "fc2");
  EXPECT_EQ(r.op, "aten::addmm");
  EXPECT_FALSE(r.propagated());
  bool named = false;
  for (const auto& in : r.inputs) named = named || in.parameter == "fc2.weight";
  EXPECT_TRUE(named) << r.message();
  clear_module_names();
}

TEST(NonFiniteGuardTest, InfOnlyInBackwardIsAttributedToTheForwardScope) {
  // sqrt(0) = 0 is fine; its gradient 1 / (2 sqrt(0)) is inf.
  auto x = torch::tensor({0.0f, 1.0f, 4.0f}, torch::requires_grad());
  torch::Tensor y;
  const auto r = expect_report([&] {
    NonFiniteGuard guard;
    {
      NamedScopeGuard scope("act");
      y = torch::sqrt(x);
    }
    y.sum().backward();
  });
  EXPECT_EQ(r.direction, Direction::kBackward);
  EXPECT_EQ(r.backward_node, "SqrtBackward0");
  EXPECT_EQ(r.scope, "act");
  EXPECT_EQ(r.op, "aten::div");
  EXPECT_EQ(r.inf_count, 1);
  EXPECT_EQ(r.first_index, (std::vector<int64_t>{0}));
}

TEST(NonFiniteGuardTest, BackwardCanBeLeftUnchecked) {
  auto x = torch::tensor({0.0f, 1.0f}, torch::requires_grad());
  NonFiniteGuard guard(NonFiniteOptions().backward(false));
  torch::sqrt(x).sum().backward();
  EXPECT_TRUE(std::isinf(x.grad()[0].item<float>()));
}

TEST(NonFiniteGuardTest, Fp16OverflowUnderAutocastNamesTheLayerOn2x) {
  if (!test::cpu_fp16_autocast()) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no float16 CPU autocast";
  }
  torch::manual_seed(0);
  TwoLayer net(1e4);  // fp32-safe; fc2's outputs pass 65504 in fp16
  name_modules(*net);
  const auto x = torch::randn({4, 8}) * 10;
  ASSERT_TRUE(torch::isfinite(net->forward(x)).all().item<bool>());
  ASSERT_GT(net->forward(x).abs().max().item<float>(), 65504.0f);
  const auto r = expect_report([&] {
    NonFiniteGuard guard;
    AutocastGuard autocast(torch::kCPU, torch::kHalf);
    (void)net->forward(x);
  });
  EXPECT_EQ(r.direction, Direction::kForward);
  EXPECT_EQ(r.scope, "fc2");
  EXPECT_EQ(r.dtype, torch::kHalf);
  EXPECT_FALSE(r.propagated()) << r.message();
  clear_module_names();
}

TEST(NonFiniteGuardTest, Bf16OverflowUnderAutocastNamesTheLayer) {
  torch::manual_seed(0);
  TwoLayer net(1e38);  // fc2's bf16 outputs pass bf16's 3.39e38; its weights stay finite
  name_modules(*net);
  const auto x = torch::randn({4, 8}) * 10;
  const auto r = expect_report([&] {
    NonFiniteGuard guard;
    AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
    (void)net->forward(x);
  });
  EXPECT_EQ(r.direction, Direction::kForward);
  EXPECT_EQ(r.scope, "fc2");
  EXPECT_EQ(r.dtype, torch::kBFloat16);
  EXPECT_FALSE(r.propagated()) << r.message();
  clear_module_names();
}

TEST(NonFiniteGuardTest, PropagatedValuesSayTheyCameFromAnInput) {
  auto x = torch::tensor({1.0f, std::numeric_limits<float>::quiet_NaN()});
  const auto r = expect_report([&] {
    NonFiniteGuard guard;
    (void)(x * 2);
  });
  EXPECT_EQ(r.op, "aten::mul");
  EXPECT_TRUE(r.propagated());
  EXPECT_EQ(r.inputs[0].non_finite, 1);
  EXPECT_THAT(r.message(), HasSubstr("the op propagated them"));
}

TEST(NonFiniteGuardTest, InPlaceOpsAreCheckedViewsAreNot) {
  auto x = torch::tensor({-1.0f, 1.0f});
  const auto r = expect_report([&] {
    NonFiniteGuard guard;
    x.log_();
  });
  EXPECT_EQ(r.op, "aten::log_");
  EXPECT_TRUE(r.in_place);
  // A view of a tensor that already holds NaN is not a new non-finite value.
  NonFiniteGuard guard;
  EXPECT_NO_THROW((void)x.view({2, 1}).transpose(0, 1));
}

TEST(NonFiniteGuardTest, DeliberateInfinitiesOfAttentionMasksAreNotFaults) {
  auto scores = torch::randn({4, 4});
  const auto causal = torch::ones({4, 4}, torch::kBool).triu(1);
  NonFiniteGuard guard;
  // masked_fill with -inf, and an additive mask built from full(-inf).
  auto p = torch::softmax(scores.masked_fill(causal, -INFINITY), -1);
  auto additive = torch::full({4, 4}, -INFINITY).triu(1);
  auto q = torch::softmax(scores + additive, -1);
  EXPECT_TRUE(torch::allclose(p, q));
  EXPECT_EQ(guard.count(), 0);
  // A real overflow next to them is still found.
  EXPECT_THROW((void)(scores + additive + torch::full({4, 4}, 3e38f) * 10), NonFiniteError);
}

TEST(NonFiniteGuardTest, WarnModeKeepsGoingAndKeepsTheFirstReports) {
  auto x = torch::tensor({-1.0f});
  NonFiniteGuard guard(NonFiniteOptions().action(NonFiniteAction::kWarn).max_reports(2));
  for (int i = 0; i < 5; ++i) (void)torch::log(x);
  EXPECT_EQ(guard.count(), 5);
  ASSERT_EQ(guard.reports().size(), 2u);
  EXPECT_EQ(guard.reports()[0].op, "aten::log");
}

TEST(NonFiniteGuardTest, NothingStaysRegisteredWithoutAGuard) {
  constexpr auto key = c10::DispatchKey::TESTING_ONLY_GenericMode;
  {
    NonFiniteGuard outer;
    {
      NonFiniteGuard inner;
      EXPECT_TRUE(c10::impl::tls_is_dispatch_key_included(key));
    }
    EXPECT_TRUE(c10::impl::tls_is_dispatch_key_included(key));
    EXPECT_TRUE(c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(key));
  }
  EXPECT_FALSE(c10::impl::tls_is_dispatch_key_included(key));
  EXPECT_FALSE(c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(key));
  EXPECT_NO_THROW((void)torch::log(torch::tensor({-1.0f})));
}

TEST(NonFiniteGuardTest, ObservedO2TrainingHasTheSameBitsAndFindsAnO2Overflow) {
  // Three O2 steps (bf16 model, fp32 masters) with and without a guard and a
  // collector: the diagnostics only read, so every bit is the same.
  auto run = [](bool observed) {
    torch::manual_seed(0);
    TwoLayer net;
    ampx::optim::AdamW opt(net->parameters(), ampx::optim::AdamWOptions(1e-2));
    auto amp = ampx::initialize(net.ptr(), {&opt}, AmpOptions(OptLevel::O2));
    name_modules(*net);
    std::unique_ptr<NonFiniteGuard> guard;
    std::unique_ptr<RangeStatsCollector> collector;
    if (observed) {
      guard = std::make_unique<NonFiniteGuard>();
      collector = std::make_unique<RangeStatsCollector>();
    }
    std::vector<torch::Tensor> out;
    for (int step = 0; step < 3; ++step) {
      const auto b = test::make_batch(step);
      opt.zero_grad();
      torch::Tensor loss;
      {
        auto forward = amp.forward_guard();
        const auto y = net->forward(amp.cast_input(b.x)).to(torch::kFloat).mean(1, true);
        loss = torch::mse_loss(y, b.y);
      }
      amp.scaler().scale(loss).backward();
      amp.scaler().step(opt);
      amp.scaler().update();
      out.push_back(loss.detach().clone());
    }
    if (observed) {
      EXPECT_GT(collector->stats().records.size(), 4u);
    }
    for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
    clear_module_names();
    return out;
  };
  EXPECT_TRUE(test::same_bits(run(false), run(true)));

  torch::manual_seed(0);
  TwoLayer big(1e38);
  ampx::initialize(big.ptr(), {}, AmpOptions(OptLevel::O2).master_weights(false));
  name_modules(*big);
  const auto r = expect_report([&] {
    NonFiniteGuard guard;
    (void)big->forward(torch::randn({4, 8}, torch::kBFloat16) * 100);
  });
  EXPECT_EQ(r.scope, "fc2");
  EXPECT_EQ(r.dtype, torch::kBFloat16);
  clear_module_names();
}

}  // namespace
}  // namespace debug
}  // namespace ampx
