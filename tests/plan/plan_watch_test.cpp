// The watch of a precision plan while training runs (ampx::plan::PlanWatch):
// a layer whose gradient its format's noise drowns, a layer whose format
// flushes part of its gradient to zero, each on real gradients of a real
// regression; the move to a wider format; a check that leaves no trace.

#include "ampx/precision_plan.h"

#include "../test_util.h"
#include "ampx/fp8/autocast.h"
#include "ampx/fp8/convert.h"

#include <torch/torch.h>

namespace ampx {
namespace {

using plan::LayerFormat;
using plan::WatchFinding;
using ::testing::HasSubstr;

// One Linear (64 -> 32, multiples of 16 and 32: every format's blocks) and,
// optionally, dropout on its input.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(double dropout = 0)
      : fc(register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(64, 32)))),
        drop(register_module("drop", torch::nn::Dropout(dropout))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc->forward(drop->forward(x)); }
  torch::nn::Linear fc;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Net);

// y = x W^T + noise, 256 rows (NVFP4's Hadamard transform takes multiples of 16).
struct Regression {
  torch::Tensor x, y, w_true;
  explicit Regression(double input_scale_of_first_32 = 1) {
    torch::manual_seed(11);
    x = torch::randn({256, 64});
    x.narrow(1, 0, 32).mul_(input_scale_of_first_32);
    w_true = 0.1 * torch::randn({32, 64});
    y = x.mm(w_true.t()) + torch::randn({256, 32});
  }
  // The loss a step takes: bf16 autocast, the plan's layers in their formats.
  torch::Tensor loss(Net& net) const {
    AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
    return torch::mse_loss(net->forward(x).to(torch::kFloat), y);
  }
};

plan::PrecisionPlan one_layer_plan(LayerFormat format) {
  plan::PrecisionPlan p;
  p.target = "b200";
  p.loss_budget = 0.005;
  p.layers.push_back({"fc", format, plan::scale_rule_of(format), 0, 0, 1, "test"});
  return p;
}

// The step's backward in the plan's formats, then the watch's check.
std::vector<plan::WatchEvent> step_and_check(Net& net, const Regression& data,
                                             plan::PlanWatch& watch, int64_t step) {
  net->zero_grad();
  {
    fp8::Fp8AutocastGuard fp8;
    data.loss(net).backward();
  }
  return watch.check(step, [&] { data.loss(net).backward(); });
}

// At the least-squares solution the true gradient is zero and the NVFP4
// gradient is its noise: reported. Far from it (zero weights) the gradient
// is large and NVFP4's noise a fraction of it: nothing reported.
TEST(PlanWatchTest, GradientBelowItsFormatsNoiseIsReportedOnlyNearTheOptimum) {
  const Regression data;
  Net net;
  plan::apply_plan(*net, one_layer_plan(LayerFormat::kNvfp4), 3);
  plan::PlanWatch watch(*net, one_layer_plan(LayerFormat::kNvfp4));
  {
    torch::NoGradGuard no_grad;
    net->fc->weight.zero_();
    net->fc->bias.zero_();
  }
  EXPECT_TRUE(step_and_check(net, data, watch, 0).empty());

  {  // the optimum: least squares in float64, bias included
    torch::NoGradGuard no_grad;
    const auto a = torch::cat({data.x, torch::ones({256, 1})}, 1).to(torch::kDouble);
    const auto sol = std::get<0>(torch::linalg_lstsq(a, data.y.to(torch::kDouble)));  // [65, 32]
    net->fc->weight.copy_(sol.narrow(0, 0, 64).t());
    net->fc->bias.copy_(sol[64]);
  }
  const auto events = step_and_check(net, data, watch, 1);
  ASSERT_EQ(events.size(), 1u);
  const auto& e = events[0];
  EXPECT_EQ(e.step, 1);
  EXPECT_EQ(e.module, "fc");
  EXPECT_EQ(e.format, LayerFormat::kNvfp4);
  EXPECT_EQ(e.finding, WatchFinding::kGradientBelowNoise);
  EXPECT_LT(e.gradient_norm, std::sqrt(3.0) * e.noise_norm);
  EXPECT_EQ(e.moved_to, LayerFormat::kNvfp4);  // reported, not moved
  EXPECT_THAT(e.message(), HasSubstr("step 1: fc (nvfp4) gradient below noise: |g| "));
  EXPECT_EQ(watch.events().size(), 1u);
}

// Inputs whose first 32 features are 1e-7 of the others: NVFP4's E4M3 block
// scales (and FP8's tensor scale) cannot reach them, so half the weight
// gradient is flushed to zero; MXFP8's E8M0 block scales can. With widen(),
// the layer moves nvfp4 -> mxfp8 and the next check finds nothing.
TEST(PlanWatchTest, UnderflowIsReportedAndWidenMovesTheLayerToTheNextFormat) {
  const Regression data(1e-7);
  Net net;
  plan::apply_plan(*net, one_layer_plan(LayerFormat::kNvfp4), 3);
  plan::PlanWatch watch(*net, one_layer_plan(LayerFormat::kNvfp4),
                        plan::WatchOptions().every(1).widen(true));
  const auto first = step_and_check(net, data, watch, 0);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].finding, WatchFinding::kUnderflow);
  EXPECT_GT(first[0].underflow, 0.45);
  EXPECT_EQ(first[0].moved_to, LayerFormat::kMxfp8);
  EXPECT_THAT(first[0].message(), HasSubstr("flushed to 0; moved to mxfp8"));
  EXPECT_EQ(watch.plan().layers[0].format, LayerFormat::kMxfp8);
  EXPECT_THAT(watch.plan().layers[0].reason, HasSubstr("moved by the watch at step 0"));
  EXPECT_EQ(fp8::scaling_of(*net->fc)->recipe.to_string(),
            plan::recipe_of(LayerFormat::kMxfp8).to_string());

  const auto second = step_and_check(net, data, watch, 1);
  EXPECT_TRUE(second.empty()) << second[0].message();
  EXPECT_EQ(watch.events().size(), 1u);
}

// A resumed run restores where the watch left the layers: a second model
// with the plan applied, restored to the first watch's formats, runs the
// moved format (the same gradient, bit for bit) and reports moved(); a
// module the plan lacks, or a format the watch does not widen to, is an
// error naming it, and nothing moves.
TEST(PlanWatchTest, RestorePutsTheLayersWhereTheWatchLeftThem) {
  const Regression data(1e-7);
  const auto plan = one_layer_plan(LayerFormat::kNvfp4);
  Net first;
  plan::apply_plan(*first, plan, 3);
  plan::PlanWatch watch(*first, plan, plan::WatchOptions().every(1).widen(true));
  ASSERT_EQ(step_and_check(first, data, watch, 0).size(), 1u);
  ASSERT_TRUE(watch.moved());
  const LayerFormat left = watch.plan().layers[0].format;  // mxfp8
  ASSERT_NE(left, LayerFormat::kNvfp4);

  Net second;
  {
    torch::NoGradGuard no_grad;
    second->fc->weight.copy_(first->fc->weight);
    second->fc->bias.copy_(first->fc->bias);
  }
  plan::apply_plan(*second, plan, 3);
  plan::PlanWatch resumed(*second, plan, plan::WatchOptions().every(1).widen(true));
  EXPECT_FALSE(resumed.moved());
  EXPECT_THAT(test::error_text([&] { resumed.restore({{"fc9", left}}); }),
              HasSubstr("module 'fc9' is not in the watched plan"));
  EXPECT_THAT(test::error_text([&] { resumed.restore({{"fc", LayerFormat::kFloat16}}); }),
              HasSubstr("layer 'fc' is in nvfp4, which the watch does not widen to fp16 on b200"));
  EXPECT_FALSE(resumed.moved());
  resumed.restore({{"fc", left}});
  EXPECT_TRUE(resumed.moved());
  EXPECT_EQ(resumed.plan().layers[0].format, left);
  EXPECT_EQ(fp8::scaling_of(*second->fc)->recipe.to_string(), plan::recipe_of(left).to_string());
  const auto gradient = [&](Net& net) {
    net->zero_grad();
    fp8::Fp8AutocastGuard fp8;
    data.loss(net).backward();
    return net->fc->weight.grad().clone();
  };
  EXPECT_TRUE(torch::equal(gradient(first), gradient(second)));
  resumed.restore({{"fc", LayerFormat::kBFloat16}});  // further along the chain
  EXPECT_EQ(fp8::scaling_of(*second->fc), nullptr);
}

// Moving to bf16 turns the layer back into a plain Linear: FP8 regions no
// longer catch it, so its gradient is bf16 autocast's bit for bit.
TEST(PlanWatchTest, WideningToBf16LeavesAPlainLinear) {
  const Regression data(1e-7);
  Net net;
  auto p = one_layer_plan(LayerFormat::kFp8Block);
  plan::apply_plan(*net, p, 0);
  EXPECT_EQ(plan::wider_format(LayerFormat::kFp8Block, "b200"), LayerFormat::kBFloat16);
  EXPECT_EQ(plan::wider_format(LayerFormat::kNvfp4, "h100"), LayerFormat::kFp8);
  EXPECT_EQ(plan::wider_format(LayerFormat::kFp8, "cpu"), LayerFormat::kFp8Block);
  fp8::reconvert_linear(*net->fc, c10::nullopt);
  EXPECT_EQ(fp8::scaling_of(*net->fc), nullptr);
  net->zero_grad();
  {
    fp8::Fp8AutocastGuard fp8;
    data.loss(net).backward();
  }
  const auto in_region = net->fc->weight.grad().clone();
  net->zero_grad();
  data.loss(net).backward();
  EXPECT_TRUE(torch::equal(in_region, net->fc->weight.grad()));
}

// Training with a check at every step ends with the same weights, bit for
// bit, as training without: the check puts back the gradients, the buffers
// and the generators (with begin_step() it draws the step's dropout masks
// again; without, it draws new ones, and the generator is put back after).
TEST(PlanWatchTest, ACheckLeavesNoTraceOnTraining) {
  const Regression data;
  enum class Watch { kNone, kBegun, kNotBegun };
  const auto train = [&](Watch mode) {
    torch::manual_seed(5);
    Net net(0.25);
    plan::apply_plan(*net, one_layer_plan(LayerFormat::kNvfp4), 3);
    plan::PlanWatch watch(*net, one_layer_plan(LayerFormat::kNvfp4),
                          plan::WatchOptions().every(1));
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05));
    for (int64_t step = 0; step < 4; ++step) {
      if (mode == Watch::kBegun) watch.begin_step(step);
      net->zero_grad();
      {
        fp8::Fp8AutocastGuard fp8;
        data.loss(net).backward();
      }
      if (mode != Watch::kNone) {
        const auto events = watch.check(step, [&] { data.loss(net).backward(); });
        for (const auto& e : events) {  // the same masks: far from the optimum, no finding
          if (mode == Watch::kBegun) ADD_FAILURE() << "a layer reported: " << e.message();
        }
      }
      sgd.step();
    }
    return net->fc->weight.detach().clone();
  };
  const auto unwatched = train(Watch::kNone);
  EXPECT_TRUE(torch::equal(train(Watch::kBegun), unwatched));
  EXPECT_TRUE(torch::equal(train(Watch::kNotBegun), unwatched));
}

TEST(PlanWatchTest, BadInputGetsErrorsNamingTheArgumentAndValue) {
  Net net;
  const auto p = one_layer_plan(LayerFormat::kFp8);
  EXPECT_THAT(test::error_text([&] { (void)plan::PlanWatch(*net, p); }),
              HasSubstr("layer 'fc' is planned in fp8 but is not converted (apply_plan first)"));
  plan::apply_plan(*net, p, 0);
  EXPECT_THAT(
      test::error_text([&] { (void)plan::PlanWatch(*net, p, plan::WatchOptions().every(0)); }),
      HasSubstr("every must be >= 1, got 0"));
  EXPECT_THAT(test::error_text(
                  [&] { (void)plan::PlanWatch(*net, p, plan::WatchOptions().noise_ratio(-1)); }),
              HasSubstr("noise_ratio must be > 0, got -1"));
  EXPECT_THAT(test::error_text([&] {
                (void)plan::PlanWatch(*net, p, plan::WatchOptions().underflow_fraction(1));
              }),
              HasSubstr("underflow_fraction must be in [0, 1), got 1"));
  auto other = p;
  other.layers[0].module = "fc2";
  EXPECT_THAT(test::error_text([&] { (void)plan::PlanWatch(*net, other); }),
              HasSubstr("module 'fc2' is not a Linear of the model (its Linears: fc)"));
  plan::PlanWatch watch(*net, p);
  EXPECT_THAT(test::error_text([&] { (void)watch.check(0, [] {}); }),
              HasSubstr("layer 'fc' has no weight gradient at step 0 (check after the backward"));
  torch::nn::Linear plain(16, 16);
  EXPECT_THAT(test::error_text([&] { fp8::reconvert_linear(*plain, c10::nullopt); }),
              HasSubstr("is not a torch::nn::Linear that convert_linears converted"));
}

}  // namespace
}  // namespace ampx
