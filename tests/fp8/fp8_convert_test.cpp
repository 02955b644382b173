// torch::nn::Linear layers converted to ampx::fp8::Linear
// (convert_to_fp8): they run as Linear does bit for bit, checkpoint their
// scaling states bitwise, train under O2 with fp32 masters, cast each tensor
// with its own amax under current scaling, and leave their states alone in
// evaluation.

#include "ampx/fp8/linear.h"

#include "../test_util.h"
#include "ampx/amp.h"
#include "ampx/autocast.h"
#include "ampx/optim.h"
#include "fp8_linear_fixture.h"

#include <torch/torch.h>

#include <sstream>
#include <string>
#include <vector>

namespace ampx {
namespace fp8 {
namespace {

using test::grid;

// A user's model holding plain torch::nn::Linear members, as most do.
struct PlainNetImpl : torch::nn::Module {
  PlainNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 16));
    head = register_module("head", torch::nn::Linear(16, 3));  // not a multiple of 16
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(fc1->forward(x));  // bf16 from an FP8 layer
    h = torch::tanh(fc2->forward(h));
    return head->forward(h.to(head->weight.scalar_type())).to(torch::kFloat);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr};
};
TORCH_MODULE(PlainNet);

// Converted torch::nn::Linear layers run exactly as ampx::fp8::Linear does,
// through the members the model already holds, and keep their state as
// buffers; the default filter leaves the 16x3 head alone.
TEST(Fp8ConvertTest, ConvertedTorchLinearsRunAsFp8LinearDoesBitForBit) {
  torch::manual_seed(0);
  PlainNet net;
  const auto recipe = DelayedScaling().amax_history_len(4);
  const auto names = convert_linears(*net, ConvertOptions().recipe(recipe));
  EXPECT_EQ(names, (std::vector<std::string>{"fc1", "fc2"}));
  EXPECT_NE(scaling_of(*net->fc1), nullptr);
  EXPECT_EQ(scaling_of(*net->head), nullptr);
  EXPECT_EQ(net->fc1->named_buffers().size(), 9u);
  EXPECT_TRUE(net->fc1->named_buffers().contains("fp8_grad_output_amax_history"));

  Linear twin(LinearOptions(16, 32).recipe(recipe));
  {
    torch::NoGradGuard no_grad;
    twin->weight.copy_(net->fc1->weight);
    twin->bias.copy_(net->fc1->bias);
  }
  for (int step = 0; step < 3; ++step) {
    const auto x = torch::randn({5, 16}) * (step + 1);
    const auto g = torch::randn({5, 32});
    Fp8AutocastGuard fp8;
    const auto y = net->fc1->forward(x);
    const auto y_twin = twin->forward(x);
    ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(y, y_twin)) << "step " << step;
    y.backward(g);
    y_twin.backward(g);
  }
  EXPECT_TRUE(torch::equal(net->fc1->weight.grad(), twin->weight.grad()));
  EXPECT_TRUE(torch::equal(net->fc1->bias.grad(), twin->bias.grad()));
  const auto& s = *scaling_of(*net->fc1);
  EXPECT_TRUE(
      torch::equal(s.input->delayed_state().amax_history(), twin->input_state().amax_history()));
  EXPECT_TRUE(torch::equal(s.grad_output->delayed_state().amax_history(),
                           twin->grad_output_state().amax_history()));
  EXPECT_NE(s.input->scale().item<float>(), 1.0f);
  // Outside a region, and for the unconverted head: the plain products.
  const auto x = torch::randn({4, 16});
  EXPECT_TRUE(
      torch::equal(net->fc1->forward(x), torch::addmm(net->fc1->bias, x, net->fc1->weight.t())));
  {
    Fp8AutocastGuard fp8;
    const auto h = torch::randn({4, 16});
    EXPECT_TRUE(torch::equal(net->head->forward(h),
                             torch::addmm(net->head->bias, h, net->head->weight.t())));
    // A user's own F::linear with a converted weight is FP8 too.
    EXPECT_EQ(torch::nn::functional::linear(x, net->fc1->weight, net->fc1->bias).scalar_type(),
              torch::kBFloat16);
  }
  EXPECT_THROW(convert_linears(*net->fc1), c10::Error);  // twice
}

// A converted model's checkpoint carries the states; it must be converted
// before loading. The next steps are then the same bitwise.
TEST(Fp8ConvertTest, ConvertedModelsCheckpointTheirStatesBitwise) {
  auto run = [](PlainNet& net, int first, int steps) {
    torch::optim::Adam opt(net->parameters(), 3e-3);
    std::vector<float> losses;
    for (int step = first; step < first + steps; ++step) {
      const auto x = torch::randn({32, 16}) * (1 + step % 3);
      opt.zero_grad();
      torch::Tensor loss;
      {
        Fp8AutocastGuard fp8;
        loss = net->forward(x).pow(2).mean();
      }
      loss.backward();
      losses.push_back(loss.item<float>());
    }
    return losses;
  };
  torch::manual_seed(1);
  PlainNet a;
  convert_linears(*a);
  run(a, 0, 4);
  std::stringstream saved;
  torch::save(a, saved);
  PlainNet b;
  convert_linears(*b);
  torch::load(b, saved);
  for (const auto& buffer : a->named_buffers()) {
    EXPECT_TRUE(torch::equal(buffer.value(), b->named_buffers()[buffer.key()])) << buffer.key();
  }
  torch::manual_seed(9);
  const auto next_a = run(a, 4, 3);
  torch::manual_seed(9);
  EXPECT_EQ(run(b, 4, 3), next_a);
}

// O2 casts the weights to bf16 and keeps fp32 masters in ampx's optimizer;
// the FP8 states stay float32, the gradients come in the weights' dtype, and
// the model learns.
TEST(Fp8ConvertTest, O2KeepsFp32MastersAndFloat32StatesAndTrains) {
  torch::manual_seed(2);
  PlainNet net;
  ampx::optim::AdamW opt(net->parameters(), ampx::optim::AdamWOptions(3e-3));
  auto amp = ampx::initialize(net.ptr(), {&opt}, ampx::AmpOptions(ampx::OptLevel::O2));
  convert_linears(*net);
  ASSERT_EQ(net->fc1->weight.scalar_type(), torch::kBFloat16);
  for (const auto& b : net->fc1->named_buffers()) {
    EXPECT_EQ(b.value().scalar_type(), torch::kFloat) << b.key();
  }
  // Converted first, cast after: the states stay float32 as well.
  PlainNet other;
  convert_linears(*other);
  ampx::optim::AdamW other_opt(other->parameters(), ampx::optim::AdamWOptions(3e-3));
  auto other_amp =
      ampx::initialize(other.ptr(), {&other_opt}, ampx::AmpOptions(ampx::OptLevel::O2));
  ASSERT_EQ(other->fc1->weight.scalar_type(), torch::kBFloat16);
  for (const auto& b : other->fc1->named_buffers()) {
    EXPECT_EQ(b.value().scalar_type(), torch::kFloat) << b.key();
  }
  std::vector<float> losses;
  torch::manual_seed(4);
  const auto x = torch::randn({64, 16});
  const auto target = torch::tanh(x.slice(1, 0, 3) * 2);
  for (int step = 0; step < 200; ++step) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      Fp8AutocastGuard fp8;
      auto forward = amp.forward_guard();
      loss = torch::mse_loss(net->forward(amp.cast_input(x)), target);
    }
    amp.scaler().scale(loss).backward();
    if (step == 0) {
      EXPECT_EQ(net->fc1->weight.grad().scalar_type(), torch::kBFloat16);
    }
    amp.scaler().step(opt);
    if (step == 0) {
      EXPECT_EQ(opt.master(net->fc1->weight).scalar_type(), torch::kFloat);
    }
    amp.scaler().update();
    losses.push_back(loss.item<float>());
  }
  EXPECT_LT(losses.back(), 0.5f * losses.front());
  // The master moved by more than bf16 can hold in one step's update.
  EXPECT_FALSE(torch::equal(opt.master(net->fc1->weight).to(torch::kBFloat16).to(torch::kFloat),
                            opt.master(net->fc1->weight)));
}

// Current scaling: every cast takes its own amax's scale (TE's
// Float8CurrentScaling); the buffers keep the last cast's amax and scale.
TEST(Fp8ConvertTest, CurrentScalingCastsEachTensorWithItsOwnAmax) {
  torch::manual_seed(5);
  Linear fc(LinearOptions(16, 8).recipe(CurrentScaling()));
  EXPECT_THROW((void)fc->input_state(), c10::Error);
  const auto x = (torch::randn({6, 16}) * 7).requires_grad_(true);
  const auto g = torch::randn({6, 8}) * 1e-3;
  at::Tensor y;
  {
    Fp8AutocastGuard fp8;
    y = fc->forward(x);
    y.backward(g);
  }
  auto cast = [](const at::Tensor& t, Fp8Format f) {
    const auto s = current_scale(compute_amax(t), f, CurrentScaling());
    return grid(t, f, s, at::ones_like(s).div(s));
  };
  const auto xq = cast(x.detach(), Fp8Format::kE4M3);
  const auto wq = cast(fc->weight.detach(), Fp8Format::kE4M3);
  EXPECT_TRUE(torch::equal(y, (xq.mm(wq.t()) + fc->bias.detach()).to(torch::kBFloat16)));
  const auto g2 = g.to(torch::kBFloat16).to(torch::kFloat);
  const auto gq = cast(g2, Fp8Format::kE5M2);
  EXPECT_TRUE(torch::equal(x.grad(), gq.mm(wq)));
  EXPECT_TRUE(torch::equal(fc->weight.grad(), gq.t().mm(xq)));
  auto& s = fc->scaling();
  EXPECT_EQ(s.input->last_amax().item<float>(), x.detach().abs().max().item<float>());
  EXPECT_EQ(s.grad_output->scale().item<float>(), 57344.0f / g2.abs().max().item<float>());
  EXPECT_TRUE(fc->named_buffers().contains("grad_output_amax"));
}

// Without a bias: two gradients, the same products.
TEST(Fp8ConvertTest, ALinearWithoutBiasRunsInFp8) {
  torch::manual_seed(8);
  Linear fc(LinearOptions(16, 8).bias(false));
  const auto x = torch::randn({4, 16}).requires_grad_(true);
  at::Tensor y;
  {
    Fp8AutocastGuard fp8;
    y = fc->forward(x);
    y.sum().backward();
  }
  const auto one = torch::ones({1});
  const auto xq = grid(x.detach(), Fp8Format::kE4M3, one, one);
  const auto wq = grid(fc->weight.detach(), Fp8Format::kE4M3, one, one);
  EXPECT_TRUE(torch::equal(y, xq.mm(wq.t()).to(torch::kBFloat16)));
  EXPECT_TRUE(fc->weight.grad().defined());
  EXPECT_TRUE(x.grad().defined());
}

// Evaluation (no grad) in a region casts with the scales it has and leaves
// the states alone, so an evaluation never changes the training that follows.
TEST(Fp8ConvertTest, InferenceLeavesTheScalingStatesAlone) {
  torch::manual_seed(6);
  Linear fc(LinearOptions(16, 8).recipe(DelayedScaling().amax_history_len(4)));
  {
    Fp8AutocastGuard fp8;
    fc->forward(torch::randn({4, 16})).sum().backward();
  }
  std::vector<at::Tensor> before;
  for (const auto& b : fc->buffers()) before.push_back(b.clone());
  {
    torch::NoGradGuard no_grad;
    Fp8AutocastGuard fp8;
    fc->forward(torch::randn({4, 16}) * 100);
  }
  const auto after = fc->buffers();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i])) << i;
}

}  // namespace
}  // namespace fp8
}  // namespace ampx
