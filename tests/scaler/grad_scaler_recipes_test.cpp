// GradScaler in the recipes of PyTorch's AMP examples: several optimizers
// skipping independently, gradient accumulation, clipping after unscale,
// gradient penalty; sparse gradients; found_inf per device; optimizers that
// take the scale instead of unscaled gradients (ScalerAwareOptimizer).

#include "ampx/grad_scaler.h"

#include "../test_util.h"
#include "ampx/autocast.h"
#include "ampx/scaler_aware_optimizer.h"
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
using ampx::test::expect_unchanged;
using ampx::test::kInf;
using ampx::test::make_batch;
using ampx::test::poison_grad;
using ampx::test::same_bits;
using ampx::test::snapshot;
using ampx::test::training_state;

using Net = ampx::test::Mlp;

TEST(GradScalerTest, SeveralOptimizersSkipIndependentlyAndUpdateOnce) {
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt1(net->fc1->parameters(), 0.1);
  torch::optim::Adam opt2(net->fc2->parameters(), 0.01);
  GradScaler scaler;
  auto b = make_batch(0);
  // Two losses, one backward each, as in PyTorch's multi-loss recipe.
  auto out = net->forward(b.x);
  auto loss1 = torch::mse_loss(out, b.y);
  auto loss2 = out.abs().mean();
  scaler.scale(loss1).backward({}, /*retain_graph=*/true);
  scaler.scale(loss2).backward();
  net->fc2->weight.mutable_grad().view(-1)[0] = kInf;  // only opt2 sees it
  const auto fc1_before = snapshot(*net->fc1);
  const auto fc2_before = training_state(*net->fc2, {&opt2});
  EXPECT_TRUE(scaler.step(opt1));
  EXPECT_FALSE(scaler.step(opt2));
  EXPECT_FALSE(same_bits(fc1_before, snapshot(*net->fc1)));
  expect_unchanged(fc2_before, training_state(*net->fc2, {&opt2}));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32768.0);  // one backoff for the iteration
}

TEST(GradScalerTest, GradientAccumulationMatchesTheBigBatch) {
  torch::manual_seed(0);
  Net big, acc;
  copy_params(*big, *acc);
  torch::optim::SGD ob(big->parameters(), 0.1), oa(acc->parameters(), 0.1);
  GradScaler scaler;
  auto full = make_batch(0, 64);
  ob.zero_grad();
  torch::mse_loss(big->forward(full.x), full.y).backward();
  ob.step();
  // 4 micro-batches of 16, losses divided by 4; one unscale_/step/update.
  oa.zero_grad();
  for (int i = 0; i < 4; ++i) {
    auto x = full.x.slice(0, 16 * i, 16 * (i + 1)), y = full.y.slice(0, 16 * i, 16 * (i + 1));
    scaler.scale(torch::mse_loss(acc->forward(x), y) / 4).backward();
  }
  EXPECT_TRUE(scaler.step(oa));
  scaler.update();
  auto pa = snapshot(*acc), pb = snapshot(*big);
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::allclose(pa[i], pb[i], 1e-6, 1e-7));
}

TEST(GradScalerTest, ClippingAfterUnscaleIsInRealUnits) {
  torch::manual_seed(0);
  Net a, b;
  copy_params(*a, *b);
  torch::optim::SGD oa(a->parameters(), 0.5), ob(b->parameters(), 0.5);
  GradScaler scaler;
  for (int step = 0; step < 5; ++step) {
    auto batch = make_batch(step);
    oa.zero_grad();
    torch::mse_loss(a->forward(batch.x), batch.y).backward();
    const double norm_a = torch::nn::utils::clip_grad_norm_(a->parameters(), 0.01);
    oa.step();
    ob.zero_grad();
    scaler.scale(torch::mse_loss(b->forward(batch.x), batch.y)).backward();
    scaler.unscale_(ob);
    const double norm_b = torch::nn::utils::clip_grad_norm_(b->parameters(), 0.01);
    EXPECT_GT(norm_b, 0.01) << "clipping must be active for this test to mean anything";
    EXPECT_EQ(norm_a, norm_b);
    scaler.step(ob);
    scaler.update();
  }
  EXPECT_TRUE(same_bits(snapshot(*a), snapshot(*b)));
}

TEST(GradScalerTest, GradientPenaltyRecipe) {
  // PyTorch's recipe: autograd::grad of the scaled loss with create_graph,
  // multiplied by 1/get_scale() (not unscale_), penalty added to the loss.
  torch::manual_seed(0);
  Net a, b;
  copy_params(*a, *b);
  torch::optim::SGD oa(a->parameters(), 0.1), ob(b->parameters(), 0.1);
  GradScaler scaler;
  for (int step = 0; step < 3; ++step) {
    auto batch = make_batch(step);
    auto penalized = [&](Net& net, bool scaled) {
      auto loss = torch::mse_loss(net->forward(batch.x), batch.y);
      auto grads = torch::autograd::grad({scaled ? scaler.scale(loss) : loss}, net->parameters(),
                                         {}, /*retain_graph=*/true, /*create_graph=*/true);
      torch::Tensor norm = torch::zeros({});
      const double inv = scaled ? 1.0 / scaler.get_scale() : 1.0;
      for (auto& g : grads) norm = norm + (g * inv).pow(2).sum();
      return loss + norm.sqrt();
    };
    oa.zero_grad();
    penalized(a, false).backward();
    oa.step();
    ob.zero_grad();
    scaler.scale(penalized(b, true)).backward();
    EXPECT_TRUE(scaler.step(ob));
    scaler.update();
  }
  auto pa = snapshot(*a), pb = snapshot(*b);
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::allclose(pa[i], pb[i], 1e-5, 1e-6));
}

TEST(GradScalerTest, SparseGradientsAreUnscaledAndChecked) {
  torch::manual_seed(0);
  torch::nn::Embedding emb(torch::nn::EmbeddingOptions(50, 4).sparse(true));
  torch::optim::SGD opt(emb->parameters(), 0.1);
  GradScaler scaler(GradScalerOptions().init_scale(1024.0));
  auto idx = torch::tensor({1, 3, 3, 7});
  scaler.scale(emb->forward(idx).sum()).backward();
  ASSERT_TRUE(emb->weight.grad().is_sparse());
  scaler.unscale_(opt);
  auto dense = emb->weight.grad().to_dense();
  EXPECT_EQ(dense[3][0].item<float>(), 2.f);  // two lookups of row 3, in real units
  EXPECT_EQ(dense[7][0].item<float>(), 1.f);
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();

  opt.zero_grad();
  scaler.scale(emb->forward(idx).sum()).backward();
  emb->weight.mutable_grad()._values().view(-1)[2] = std::nanf("");
  EXPECT_FALSE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 512.0);
}

TEST(GradScalerTest, FoundInfPerDeviceIsWhatStepReads) {
  // What a data-parallel all-reduce(MAX) does: flip another rank's verdict.
  torch::manual_seed(0);
  Net net;
  torch::optim::Adam opt(net->parameters(), 0.01);
  GradScaler scaler;
  auto b = make_batch(0);
  scaler.scale(torch::mse_loss(net->forward(b.x), b.y)).backward();
  scaler.unscale_(opt);
  auto flags = scaler.found_inf_per_device(opt);
  ASSERT_EQ(flags.size(), 1u);
  EXPECT_EQ(flags[0].item<float>(), 0.f);
  flags[0].fill_(1.f);  // "another rank overflowed"
  const auto before = training_state(*net, {&opt});
  EXPECT_FALSE(scaler.step(opt));
  expect_unchanged(before, training_state(*net, {&opt}));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32768.0);
}

// A scaler-aware optimizer: plain SGD that divides by grad_scale and skips on
// found_inf inside its own step, with tensor ops only (no host sync).
class ScaledSGD : public torch::optim::SGD, public ampx::ScalerAwareOptimizer {
 public:
  ScaledSGD(std::vector<torch::Tensor> params, double lr) : SGD(std::move(params), lr), lr_(lr) {}
  void step_scaled(const torch::Tensor& grad_scale, const torch::Tensor& found_inf) override {
    torch::NoGradGuard no_grad;
    ++calls;
    last_scale_defined = grad_scale.defined();
    const auto keep = found_inf.ne(0);
    for (auto& p : param_groups()[0].params()) {
      auto g = p.grad().to(torch::kFloat);
      if (grad_scale.defined()) g = g / grad_scale;
      p.copy_(torch::where(keep, p, p - lr_ * g));
    }
  }
  int calls = 0;
  bool last_scale_defined = false;

 private:
  double lr_;
};

TEST(GradScalerTest, ScalerAwareOptimizerGetsTheScaleInsteadOfUnscaledGrads) {
  torch::manual_seed(0);
  Net a, b;
  copy_params(*a, *b);
  torch::optim::SGD plain(a->parameters(), 0.1);
  ScaledSGD aware(b->parameters(), 0.1);
  GradScaler scaler(GradScalerOptions().init_scale(1024.0));
  for (int step = 0; step < 4; ++step) {
    auto batch = make_batch(step);
    plain.zero_grad();
    torch::mse_loss(a->forward(batch.x), batch.y).backward();
    plain.step();
    aware.zero_grad();
    scaler.scale(torch::mse_loss(b->forward(batch.x), batch.y)).backward();
    if (step % 2 == 1) scaler.unscale_(aware);  // both paths
    const auto scaled_grad = b->fc1->weight.grad().clone();
    auto result = scaler.step(aware);
    EXPECT_TRUE(result.found_inf().defined());
    EXPECT_TRUE(result.stepped());
    EXPECT_EQ(aware.last_scale_defined, step % 2 == 0);
    if (step % 2 == 0) {  // not unscaled by the scaler: still scaled
      EXPECT_TRUE(torch::equal(b->fc1->weight.grad(), scaled_grad));
    }
    scaler.update();
  }
  EXPECT_EQ(aware.calls, 4);
  auto pa = snapshot(*a), pb = snapshot(*b);
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::allclose(pa[i], pb[i], 1e-6, 1e-7));

  aware.zero_grad();
  scaler.scale(torch::mse_loss(b->forward(make_batch(9).x), make_batch(9).y)).backward();
  poison_grad(*b);
  const auto before = snapshot(*b);
  EXPECT_FALSE(scaler.step(aware));
  EXPECT_TRUE(same_bits(before, snapshot(*b)));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 512.0);
}

TEST(GradScalerTest, ScalerAwareOptimizerMayHaveFp16Grads) {
  auto p = torch::zeros({4}, torch::requires_grad());
  p.mutable_grad() = torch::full({4}, 8.0, torch::kHalf);
  ScaledSGD aware({p}, 1.0);
  GradScaler scaler(GradScalerOptions().init_scale(8.0));
  scaler.scale(torch::ones({}));
  EXPECT_TRUE(scaler.step(aware));  // PyTorch allows fp16 here (allow_fp16=True)
  EXPECT_TRUE(torch::equal(p.detach(), torch::full({4}, -1.0)));
}

}  // namespace
