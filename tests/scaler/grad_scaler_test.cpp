// GradScaler: PyTorch's semantics, defaults and error texts, on real training.

#include "ampx/grad_scaler.h"

#include "../test_util.h"
#include "ampx/autocast.h"
#include "ampx/serialize.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>

namespace {

using ampx::GradScaler;
using ampx::GradScalerOptions;
using ampx::OptState;
using ampx::test::Batch;
using ampx::test::copy_params;
using ampx::test::cpu_fp16_autocast;
using ampx::test::error_text;
using ampx::test::expect_unchanged;
using ampx::test::make_batch;
using ampx::test::same_bits;
using ampx::test::snapshot;
using ampx::test::training_state;

using ampx::test::kInf;
using ampx::test::poison_grad;

using Net = ampx::test::Mlp;


TEST(GradScalerTest, DefaultsArePyTorchs) {
  GradScaler s;
  EXPECT_TRUE(s.is_enabled());
  EXPECT_EQ(s.get_scale(), 65536.0);
  EXPECT_EQ(s.get_growth_factor(), 2.0);
  EXPECT_EQ(s.get_backoff_factor(), 0.5);
  EXPECT_EQ(s.get_growth_interval(), 2000);
  EXPECT_EQ(s.get_hysteresis(), 1);
  EXPECT_FALSE(s.get_min_scale().has_value());
  EXPECT_FALSE(s.get_max_scale().has_value());  // no ceiling, as PyTorch
  EXPECT_FALSE(s.get_scale_async().defined());  // lazily created, as in PyTorch
}

TEST(GradScalerTest, ScaleMultipliesOnTheOutputsDevice) {
  GradScaler s(GradScalerOptions().init_scale(8.0));
  auto loss = torch::tensor(1.5f);
  EXPECT_EQ(s.scale(loss).item<float>(), 12.f);
  ASSERT_TRUE(s.get_scale_async().defined());
  EXPECT_EQ(s.get_scale_async().dim(), 0);
  EXPECT_EQ(s.get_scale_async().scalar_type(), torch::kFloat);
  auto many = s.scale(std::vector<torch::Tensor>{torch::ones({2}), torch::full({3}, 2.f)});
  EXPECT_TRUE(torch::equal(many[1], torch::full({3}, 16.f)));
}

TEST(GradScalerTest, BacksOffAndSkipsOnInf) {
  torch::manual_seed(0);
  Net net;
  // Momentum: a step that ran would leave a momentum buffer behind.
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  GradScaler scaler(GradScalerOptions().growth_interval(3));
  auto b = make_batch(1);
  opt.zero_grad();
  scaler.scale(torch::mse_loss(net->forward(b.x), b.y)).backward();
  poison_grad(*net);
  const auto before = snapshot(*net);
  const auto state_before = training_state(*net, {&opt});
  EXPECT_FALSE(scaler.step(opt));
  EXPECT_TRUE(same_bits(before, snapshot(*net))) << "a step with inf grads must be skipped";
  expect_unchanged(state_before, training_state(*net, {&opt}));
  EXPECT_EQ(scaler.stage(opt), OptState::kStepped);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32768.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
  EXPECT_EQ(scaler.stage(opt), OptState::kReady);

  // A clean step steps, with gradients in real units.
  opt.zero_grad();
  auto loss = torch::mse_loss(net->forward(b.x), b.y);
  scaler.scale(loss).backward();
  scaler.unscale_(opt);
  EXPECT_EQ(scaler.stage(opt), OptState::kUnscaled);
  EXPECT_TRUE(scaler.step(opt));
  EXPECT_FALSE(same_bits(before, snapshot(*net)));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32768.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 1);
  EXPECT_EQ(scaler.found_inf_per_device(opt).size(), 0u);  // reset by update()
}

TEST(GradScalerTest, UnscaledGradientsEqualUnscaledTrainingBitwise) {
  // Power-of-two scales are exact: scaled-then-unscaled fp32 grads are the
  // plain grads bit for bit, so the two trainings coincide exactly.
  torch::manual_seed(0);
  Net a, b;
  copy_params(*a, *b);
  torch::optim::SGD oa(a->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ob(b->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  GradScaler scaler(GradScalerOptions().growth_interval(4));
  for (int step = 0; step < 20; ++step) {
    auto batch = make_batch(step);
    oa.zero_grad();
    torch::mse_loss(a->forward(batch.x), batch.y).backward();
    oa.step();
    ob.zero_grad();
    scaler.scale(torch::mse_loss(b->forward(batch.x), batch.y)).backward();
    ASSERT_TRUE(scaler.step(ob));
    scaler.update();
  }
  EXPECT_EQ(scaler.get_scale(), 65536.0 * 32);  // grew every 4 clean steps
  EXPECT_TRUE(same_bits(snapshot(*a), snapshot(*b)));
}

TEST(GradScalerTest, GrowsAfterGrowthIntervalCleanSteps) {
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net->parameters(), 0.01);
  GradScaler scaler(GradScalerOptions().init_scale(4.0).growth_interval(5));
  std::vector<double> scales;
  for (int step = 0; step < 12; ++step) {
    auto b = make_batch(step);
    opt.zero_grad();
    scaler.scale(torch::mse_loss(net->forward(b.x), b.y)).backward();
    scaler.step(opt);
    scaler.update();
    scales.push_back(scaler.get_scale());
  }
  const std::vector<double> want = {4, 4, 4, 4, 8, 8, 8, 8, 8, 16, 16, 16};
  EXPECT_EQ(scales, want);
  EXPECT_EQ(scaler.get_growth_tracker(), 2);
}

TEST(GradScalerTest, HysteresisSkipsButHoldsTheScale) {
  torch::manual_seed(0);
  Net net;
  torch::optim::Adam opt(net->parameters(), 0.01);
  GradScaler scaler(GradScalerOptions().init_scale(1024.0).hysteresis(2));
  auto b = make_batch(0);
  std::vector<double> scales;
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    scaler.scale(torch::mse_loss(net->forward(b.x), b.y)).backward();
    poison_grad(*net);
    const auto before = training_state(*net, {&opt});
    EXPECT_FALSE(scaler.step(opt));
    expect_unchanged(before, training_state(*net, {&opt}));
    scaler.update();
    scales.push_back(scaler.get_scale());
  }
  EXPECT_EQ(scales, (std::vector<double>{1024, 512, 256}));
}

TEST(GradScalerTest, MisuseErrorsArePyTorchs) {
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net->parameters(), 0.1);
  GradScaler scaler;
  EXPECT_EQ(error_text([&] { scaler.update(); }),
            "Attempted update but _scale is None.  This may indicate your script did not use "
            "scaler.scale(loss or outputs) earlier in the iteration.");
  EXPECT_EQ(error_text([&] { scaler.unscale_(opt); }),
            "Attempted unscale_ but _scale is None.  This may indicate your script did not use "
            "scaler.scale(loss or outputs) earlier in the iteration.");
  EXPECT_EQ(error_text([&] { scaler.step(opt); }),
            "Attempted step but _scale is None.  This may indicate your script did not use "
            "scaler.scale(loss or outputs) earlier in the iteration.");

  {
    GradScaler fresh;
    fresh.scale(torch::ones({}));
    EXPECT_EQ(error_text([&] { fresh.update(); }),
              "No inf checks were recorded prior to update.");
    auto lonely = torch::zeros({1}, torch::requires_grad());  // never gets a grad
    torch::optim::SGD no_grads({lonely}, 0.1);
    EXPECT_EQ(error_text([&] { fresh.step(no_grads); }),
              "No inf checks were recorded for this optimizer.");
  }
  auto b = make_batch(0);
  auto loss = scaler.scale(torch::mse_loss(net->forward(b.x), b.y));
  loss.backward();
  scaler.unscale_(opt);
  EXPECT_EQ(error_text([&] { scaler.unscale_(opt); }),
            "unscale_() has already been called on this optimizer since the last update().");
  scaler.step(opt);
  EXPECT_EQ(error_text([&] { scaler.unscale_(opt); }),
            "unscale_() is being called after step().");
  EXPECT_EQ(error_text([&] { scaler.step(opt); }),
            "step() has already been called since the last update().");
  scaler.update();

  const std::string reason =
      "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor "
      "with requires_grad=False.";
  EXPECT_EQ(error_text([&] { scaler.update(torch::ones({2})); }), reason);
  EXPECT_EQ(error_text([&] { scaler.update(torch::ones({1}, torch::requires_grad())); }), reason);
  scaler.update(torch::full({1}, 128.f));
  EXPECT_EQ(scaler.get_scale(), 128.0);
}

TEST(GradScalerTest, Fp16GradientsAreRefusedByUnscale) {
  auto p = torch::zeros({4}, torch::requires_grad());
  p.mutable_grad() = torch::ones({4}, torch::kHalf);
  torch::optim::SGD opt({p}, 0.1);
  GradScaler scaler;
  scaler.scale(torch::ones({}));
  try {
    scaler.unscale_(opt);
    FAIL() << "expected a ValueError";
  } catch (const c10::ValueError& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()), "Attempting to unscale FP16 gradients.");
  }
}

TEST(GradScalerTest, ConstructorChecks) {
  EXPECT_EQ(error_text([] { GradScaler s(GradScalerOptions().growth_factor(1.0)); }),
            "The growth factor must be > 1.0.");
  EXPECT_EQ(error_text([] { GradScaler s(GradScalerOptions().backoff_factor(1.0)); }),
            "The backoff factor must be < 1.0.");
  EXPECT_EQ(error_text([] { GradScaler s(GradScalerOptions().init_scale(-1)); }),
            "GradScaler: init_scale must be finite and > 0, got -1");
  EXPECT_EQ(error_text([] { GradScaler s(GradScalerOptions().growth_interval(0)); }),
            "GradScaler: growth_interval must be > 0, got 0");
  EXPECT_EQ(error_text([] { GradScaler s(GradScalerOptions().hysteresis(0)); }),
            "GradScaler: hysteresis must be >= 1, got 0");
  EXPECT_EQ(error_text([] { GradScaler s(GradScalerOptions().min_scale(8.0).max_scale(4.0)); }),
            "GradScaler: min_scale (8) must not exceed max_scale (4)");
  // Disabled scalers check nothing, as in PyTorch.
  EXPECT_EQ(error_text([] { GradScaler s(GradScalerOptions().enabled(false).growth_factor(0)); }),
            "");
}

TEST(GradScalerTest, DisabledIsAPassThrough) {
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net->parameters(), 0.1);
  GradScaler scaler(GradScalerOptions().enabled(false));
  auto b = make_batch(0);
  auto loss = torch::mse_loss(net->forward(b.x), b.y);
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  loss.backward();
  poison_grad(*net, 1.0f);
  const auto before = snapshot(*net);
  scaler.unscale_(opt);
  EXPECT_TRUE(scaler.step(opt));
  EXPECT_FALSE(same_bits(before, snapshot(*net)));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_TRUE(scaler.state_dict().empty());
}

// ---- real float16 overflow and underflow (CPU float16 autocast: LibTorch 2.x)

TEST(GradScalerTest, RealFp16OverflowBacksOffAndSkipsThenTrains) {
  if (!cpu_fp16_autocast()) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no float16 CPU autocast";
  }
  torch::manual_seed(0);
  Net net;
  torch::optim::Adam opt(net->parameters(), 0.01);
  // 2^28: the scaled loss gradient reaching the fp16 matmuls is far past 65504.
  GradScaler scaler(GradScalerOptions().init_scale(std::ldexp(1.0, 28)).max_scale(c10::nullopt));
  auto b = make_batch(0, 64);
  int skipped = 0;
  std::vector<double> losses;
  for (int step = 0; step < 60; ++step) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      ampx::AutocastGuard autocast(torch::kCPU, torch::kHalf);
      auto out = net->forward(b.x);
      EXPECT_EQ(out.scalar_type(), torch::kHalf);
      loss = torch::mse_loss(out, b.y);
    }
    losses.push_back(loss.item<double>());
    scaler.scale(loss).backward();
    const auto before = training_state(*net, {&opt});
    const double scale_before = scaler.get_scale();
    const bool stepped = scaler.step(opt).stepped();
    if (!stepped) expect_unchanged(before, training_state(*net, {&opt}));
    scaler.update();
    if (!stepped) {
      ++skipped;
      EXPECT_EQ(scaler.get_scale(), scale_before / 2);
    }
  }
  EXPECT_GE(skipped, 5) << "2^28 must overflow fp16 for several steps";
  EXPECT_LT(skipped, 20);
  EXPECT_LT(scaler.get_scale(), std::ldexp(1.0, 24));
  EXPECT_LT(losses.back(), 0.7 * losses.front()) << "training must go on after the backoff";
}

TEST(GradScalerTest, ScalingRescuesFp16GradientsFromUnderflow) {
  if (!cpu_fp16_autocast()) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no float16 CPU autocast";
  }
  // A loss of order 1e-9: its fp16 backward flushes to zero without scaling.
  auto run = [](double init_scale, bool enabled) {
    torch::manual_seed(0);
    Net net;
    torch::optim::SGD opt(net->parameters(), 0.1);
    GradScaler scaler(GradScalerOptions().init_scale(init_scale).enabled(enabled));
    auto b = make_batch(0);
    torch::Tensor loss;
    {
      ampx::AutocastGuard autocast(torch::kCPU, torch::kHalf);
      loss = torch::mse_loss(net->forward(b.x), b.y) * 1e-9;
    }
    scaler.scale(loss).backward();
    scaler.unscale_(opt);
    return net->fc1->weight.grad().abs().max().item<double>();
  };
  EXPECT_EQ(run(1.0, false), 0.0) << "without scaling the fp16 gradients underflow";
  EXPECT_GT(run(65536.0, true), 0.0) << "scaled by 2^16 they survive";
}

TEST(GradScalerTest, CudaTrainingStepSkipsOnOverflow) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
  torch::manual_seed(0);
  Net net;
  net->to(torch::kCUDA);
  torch::optim::SGD opt(net->parameters(), 0.05);
  GradScaler scaler(GradScalerOptions().init_scale(std::ldexp(1.0, 28)).max_scale(c10::nullopt));
  auto b = make_batch(0, 64);
  auto x = b.x.cuda(), y = b.y.cuda();
  int skipped = 0;
  for (int step = 0; step < 30; ++step) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      ampx::AutocastGuard autocast(torch::kCUDA, torch::kHalf);
      loss = torch::mse_loss(net->forward(x), y);
    }
    scaler.scale(loss).backward();
    const auto before = training_state(*net, {&opt});
    if (!scaler.step(opt)) {
      ++skipped;
      expect_unchanged(before, training_state(*net, {&opt}));
    }
    scaler.update();
  }
  EXPECT_GE(skipped, 5);
  EXPECT_TRUE(scaler.get_scale_async().is_cuda());
  // The state dict of a CUDA scaler loads into a CPU one and back.
  GradScaler cpu_scaler;
  cpu_scaler.load_state_dict(scaler.state_dict());
  EXPECT_EQ(cpu_scaler.get_scale(), scaler.get_scale());
}

TEST(GradScalerTest, CudaBf16GradientsAreUnscaledAndChecked) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
  // bf16 params (pure bf16 training): ATen's CUDA unscale has no bf16 kernel.
  auto p = torch::ones({1000}, torch::dtype(torch::kBFloat16).device(torch::kCUDA))
               .requires_grad_();
  torch::optim::SGD opt({p}, 1.0);
  GradScaler scaler(GradScalerOptions().init_scale(256.0));
  scaler.scale((p.to(torch::kFloat) * 2).sum()).backward();
  scaler.unscale_(opt);
  EXPECT_TRUE(torch::equal(p.grad().cpu(), torch::full({1000}, 2.0, torch::kBFloat16)));
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  opt.zero_grad();
  scaler.scale((p.to(torch::kFloat) * 2).sum()).backward();
  p.mutable_grad()[999] = INFINITY;
  EXPECT_FALSE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 128.0);
}

}  // namespace
