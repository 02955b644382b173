// ampx::fp8::Linear: forward and backward are exactly the delayed-scaling
// recipe's emulation (the casts themselves are pinned by fp8_cast_test), the
// states move as TE's rule says, checkpoints keep them bitwise, and a model
// trains in FP8 as it does in fp32.

#include "ampx/fp8/linear.h"

#include "ampx/autocast.h"
#include "test_util.h"

#include <numeric>
#include <sstream>

namespace ampx {
namespace fp8 {
namespace {

// What the recipe defines: cast to the FP8 grid with the given scale, back.
at::Tensor grid(const at::Tensor& x, Fp8Format f, const at::Tensor& scale,
                const at::Tensor& scale_inv) {
  return dequantize(quantize(x, f, scale), f, scale_inv, at::kFloat);
}

TEST(Fp8LinearTest, ForwardAndBackwardAreTheRecipesEmulation) {
  torch::manual_seed(0);
  Linear fc(LinearOptions(16, 8).recipe(DelayedScaling().amax_history_len(4)));
  auto x = torch::randn({2, 3, 16});
  {
    Fp8AutocastGuard fp8;
    fc->forward(x * 3).sum().backward();  // a first step: scales move off 1
  }
  fc->zero_grad();
  x.requires_grad_(true);
  const auto xs = fc->input_state().scale().clone(), xsi = fc->input_state().scale_inv().clone();
  const auto ws = fc->weight_state().scale().clone(), wsi = fc->weight_state().scale_inv().clone();
  const auto gs = fc->grad_output_state().scale().clone();
  const auto gsi = fc->grad_output_state().scale_inv().clone();
  ASSERT_NE(xs.item<float>(), 1.0f);
  ASSERT_NE(gs.item<float>(), 1.0f);
  EXPECT_EQ(fc->grad_output_state().format(), Fp8Format::kE5M2);  // HYBRID

  at::Tensor y;
  const auto g = torch::randn({2, 3, 8});
  {
    Fp8AutocastGuard fp8;
    y = fc->forward(x);
    y.backward(g);
  }
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  const auto x2 = x.detach().reshape({6, 16});
  const auto xq = grid(x2, Fp8Format::kE4M3, xs, xsi);
  const auto wq = grid(fc->weight.detach(), Fp8Format::kE4M3, ws, wsi);
  const auto want_y = (xq.mm(wq.t()) + fc->bias.detach()).to(torch::kBFloat16).view({2, 3, 8});
  EXPECT_TRUE(torch::equal(y, want_y));
  const auto g2 = g.to(torch::kBFloat16).to(torch::kFloat).reshape({6, 8});
  const auto gq = grid(g2, Fp8Format::kE5M2, gs, gsi);
  EXPECT_TRUE(torch::equal(x.grad(), gq.mm(wq).view({2, 3, 16})));
  EXPECT_TRUE(torch::equal(fc->weight.grad(), gq.t().mm(xq)));
  EXPECT_TRUE(torch::equal(fc->bias.grad(), g2.sum(0)));
  // This step's amaxes are the newest history entries and set the next scales.
  const float amax = x2.abs().max().item<float>();
  EXPECT_EQ(fc->input_state().amax_history()[3].item<float>(), amax);
  const float window_max = fc->input_state().amax_history().max().item<float>();
  EXPECT_EQ(fc->input_state().scale().item<float>(), 448.0f / window_max);
}

TEST(Fp8LinearTest, OutsideTheRegionItIsAPlainLinear) {
  torch::manual_seed(0);
  Linear fc(8, 4);
  const auto x = torch::randn({5, 8});
  EXPECT_FALSE(is_fp8_enabled());
  EXPECT_TRUE(torch::equal(fc->forward(x), torch::nn::functional::linear(x, fc->weight, fc->bias)));
  {
    Fp8AutocastGuard on;
    EXPECT_TRUE(is_fp8_enabled());
    {
      Fp8AutocastGuard off(false);
      EXPECT_FALSE(is_fp8_enabled());
    }
    EXPECT_TRUE(is_fp8_enabled());
  }
  EXPECT_FALSE(is_fp8_enabled());
  // The states did not move outside a region.
  Linear fresh(8, 4);
  (void)fresh->forward(x);
  EXPECT_EQ(fresh->input_state().scale().item<float>(), 1.0f);
}

TEST(Fp8LinearTest, OutputDtypeFollowsAutocastOrTheOption) {
  Linear fc(8, 4);
  Linear wide(LinearOptions(8, 4).output_dtype(torch::kFloat));
  const auto x = torch::randn({3, 8});
  Fp8AutocastGuard fp8;
  EXPECT_EQ(wide->forward(x).scalar_type(), torch::kFloat);
  AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
  EXPECT_EQ(fc->forward(x).scalar_type(), torch::kBFloat16);
  EXPECT_THROW((void)fc->forward(torch::randn({3, 7})), c10::Error);
}

struct Fp8MlpImpl : torch::nn::Module {
  Fp8MlpImpl() {
    fc1 = register_module("fc1", Linear(8, 64));
    fc2 = register_module("fc2", Linear(LinearOptions(64, 1).output_dtype(torch::kFloat)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2->forward(torch::tanh(fc1->forward(x).to(torch::kFloat)));
  }
  Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Fp8Mlp);

// `steps` Adam steps on the regression batches, in FP8 or not; the losses.
std::vector<float> train(Fp8Mlp& net, bool fp8, int steps, int first = 0) {
  torch::optim::Adam opt(net->parameters(), 3e-3);
  std::vector<float> losses;
  for (int step = first; step < first + steps; ++step) {
    const auto b = test::make_batch(step % 8, 64);
    opt.zero_grad();
    Fp8AutocastGuard region(fp8);
    auto loss = torch::mse_loss(net->forward(b.x), b.y);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<float>());
  }
  return losses;
}

TEST(Fp8LinearTest, TrainsAsFp32Does) {
  torch::manual_seed(3);
  Fp8Mlp a;
  Fp8Mlp b;
  test::copy_params(*a, *b);
  const auto fp32 = train(a, false, 300);
  const auto fp8 = train(b, true, 300);
  auto tail = [](const std::vector<float>& v) {
    return std::accumulate(v.end() - 20, v.end(), 0.0) / 20;
  };
  // Measured: fp32 0.649 -> 0.188, FP8 0.650 -> 0.192 (mean of the last 20).
  EXPECT_LT(tail(fp8), 0.4 * fp8.front());        // it learns
  EXPECT_LT(tail(fp8), tail(fp32) * 1.5 + 1e-3);  // about as well as fp32
  EXPECT_NE(fp8, fp32);                           // and it really ran in FP8
}

TEST(Fp8LinearTest, CheckpointsKeepTheScalingStatesBitwise) {
  torch::manual_seed(0);
  Fp8Mlp a;
  train(a, true, 5);
  std::stringstream saved;
  torch::save(a, saved);
  Fp8Mlp b;
  torch::load(b, saved);
  for (const auto& buffer : a->named_buffers()) {
    EXPECT_TRUE(torch::equal(buffer.value(), b->named_buffers()[buffer.key()])) << buffer.key();
  }
  EXPECT_TRUE(torch::equal(a->fc1->input_state().scale(), b->fc1->input_state().scale()));
  EXPECT_NE(a->fc1->input_state().scale().item<float>(), 1.0f);
  // The same next steps from either.
  EXPECT_EQ(train(a, true, 3, 5), train(b, true, 3, 5));
}

}  // namespace
}  // namespace fp8
}  // namespace ampx
