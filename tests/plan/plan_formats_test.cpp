// A precision plan's wide formats (ampx/precision_plan.h): an fp32 layer
// runs float32 products inside bf16 autocast, an fp16 layer float16
// products whose operands it scales per tensor, so that activations beyond
// float16's largest value and gradients far below its smallest subnormal
// keep their value; the watch moves an fp16 layer whose inputs span more
// than float16's range to fp32.

#include "ampx/precision_plan.h"

#include "../test_util.h"
#include "ampx/fp8/autocast.h"
#include "ampx/fp8/convert.h"

#include <torch/torch.h>

namespace ampx {
namespace plan_formats_test {  // a name of its own: the unity build joins test files
namespace {

using plan::LayerFormat;
using ::testing::HasSubstr;

plan::PrecisionPlan one_layer_plan(LayerFormat format) {
  plan::PrecisionPlan p;
  p.target = "b200";
  p.loss_budget = 0.005;
  p.layers.push_back({"", format, plan::scale_rule_of(format), 0, 0, 1, "test"});
  return p;
}

// A layer's output and gradients from one forward and backward of
// `loss_scale` * mean((fc(x))^2).
struct Pass {
  torch::Tensor y, dx, dw, db;
};

enum class Region { kPlan, kPlanOff, kNone };

Pass run(torch::nn::Linear& fc, const torch::Tensor& x, double loss_scale, Region region,
         bool autocast = true) {
  fc->zero_grad();
  const auto xg = x.clone().requires_grad_(true);
  torch::Tensor y;
  {
    AutocastGuard guard(torch::kCPU, torch::kBFloat16, autocast);
    fp8::Fp8AutocastGuard fp8(region == Region::kPlan);
    y = fc->forward(xg);
  }
  (y.to(torch::kFloat).pow(2).mean() * loss_scale).backward();
  return {y.detach(), xg.grad(), fc->weight.grad().clone(), fc->bias.grad().clone()};
}

double relative_error(const torch::Tensor& a, const torch::Tensor& ref) {
  return (a.to(torch::kDouble) - ref.to(torch::kDouble)).norm().item<double>() /
         ref.to(torch::kDouble).norm().item<double>();
}

torch::nn::Linear layer(int64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Linear(64, 48);
}

// Inside bf16 autocast and an FP8 region an fp32 layer is float32 bit for
// bit (output and every gradient); with FP8 off it is bf16 autocast's layer
// again, bit for bit.
TEST(PlanFormatsTest, Fp32LayerIsFloat32InsideBf16Autocast) {
  torch::manual_seed(1);
  const auto x = torch::randn({128, 64});
  auto fc = layer(2);
  auto plain = layer(2);
  const Pass float32 = run(plain, x, 1.0, Region::kNone, /*autocast=*/false);
  const Pass bf16 = run(plain, x, 1.0, Region::kNone);
  ASSERT_EQ(bf16.y.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(plan::apply_plan(*fc, one_layer_plan(LayerFormat::kFloat32)),
            std::vector<std::string>{""});
  EXPECT_EQ(fp8::scaling_of(*fc), nullptr);  // no FP8 state
  const Pass wide = run(fc, x, 1.0, Region::kPlan);
  EXPECT_EQ(wide.y.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(wide.y, float32.y));
  EXPECT_TRUE(torch::equal(wide.dx, float32.dx));
  EXPECT_TRUE(torch::equal(wide.dw, float32.dw));
  EXPECT_TRUE(torch::equal(wide.db, float32.db));
  const Pass off = run(fc, x, 1.0, Region::kPlanOff);
  EXPECT_TRUE(torch::equal(off.y, bf16.y));
  EXPECT_TRUE(torch::equal(off.dw, bf16.dw));
}

// An fp16 layer's output and gradients are closer to float32's than bf16
// autocast's are (3 more mantissa bits), even where the loss is scaled by
// 1e-12 so that every gradient lies far below float16's smallest subnormal
// (6e-8), where the inputs are scaled by 1e6 or the weights by 1e7 so that
// most lie beyond its largest value (65504), and where the weights are scaled by
// 1e-7 so that they all lie below its smallest subnormal: each product's
// operands are scaled per tensor (unscaled, float16 would flush the
// gradients and weights to zero and make the activations inf; the planted
// tests saw each).
TEST(PlanFormatsTest, Fp16LayerKeepsValuesFarOutsideFloat16sRange) {
  torch::manual_seed(3);
  const auto x = torch::randn({128, 64});
  for (const auto& [loss_scale, input_scale, weight_scale] :
       {std::make_tuple(1.0, 1.0, 1.0), std::make_tuple(1e-12, 1.0, 1.0),
        std::make_tuple(1.0, 1e6, 1.0), std::make_tuple(1.0, 1.0, 1e7),
        std::make_tuple(1.0, 1.0, 1e-7)}) {
    SCOPED_TRACE(::testing::Message() << "loss x " << loss_scale << ", input x " << input_scale
                                      << ", weight x " << weight_scale);
    auto fc = layer(4);
    auto plain = layer(4);
    {
      torch::NoGradGuard no_grad;
      fc->weight.mul_(weight_scale);
      plain->weight.mul_(weight_scale);
    }
    plan::apply_plan(*fc, one_layer_plan(LayerFormat::kFloat16));
    const auto xs = x * input_scale;
    const Pass float32 = run(plain, xs, loss_scale, Region::kNone, /*autocast=*/false);
    const Pass bf16 = run(plain, xs, loss_scale, Region::kNone);
    const Pass half = run(fc, xs, loss_scale, Region::kPlan);
    ASSERT_EQ(half.y.scalar_type(), torch::kFloat);
    if (input_scale > 1 || weight_scale > 1) {  // beyond float16's largest value
      const auto& big = input_scale > 1 ? xs : fc->weight;
      EXPECT_GT((big.abs() > 65504).to(torch::kFloat).mean().item<double>(), 0.5);
      EXPECT_GT(float32.y.abs().max().item<double>(), 65504.0);
    }
    if (weight_scale < 1) {  // below float16's smallest subnormal
      EXPECT_LT(fc->weight.abs().max().item<double>(), 3e-8);
    }
    if (loss_scale < 1) {  // every gradient below float16's smallest subnormal
      EXPECT_LT(float32.dw.abs().max().item<double>(), 6e-8);
      EXPECT_LT(float32.dx.abs().max().item<double>(), 6e-8);
    }
    for (const auto& [got, bf, ref, name] :
         {std::make_tuple(half.y, bf16.y.to(torch::kFloat), float32.y, "y"),
          std::make_tuple(half.dx, bf16.dx, float32.dx, "dx"),
          std::make_tuple(half.dw, bf16.dw, float32.dw, "dw"),
          std::make_tuple(half.db, bf16.db, float32.db, "db")}) {
      const double e16 = relative_error(got, ref);
      const double ebf = relative_error(bf, ref);
      EXPECT_LT(e16, 2e-3) << name;
      EXPECT_LT(e16, ebf / 3) << name << ": bf16's error " << ebf;
    }
  }
}

// The scale keeps each backward product's worst case within float16's
// range: 65536 rows whose first feature is 4 and an output gradient of 0.3
// sum to a weight gradient of 78643 in that column, beyond 65504 (a scale
// that only brought the gradient's largest value near 1 made it inf). With
// no rows, the gradients are zeros.
TEST(PlanFormatsTest, Fp16ProductsOfManyRowsDoNotOverflowAndNoRowsGiveZeros) {
  torch::manual_seed(8);
  auto x = torch::rand({65536, 64});
  x.select(1, 0).fill_(4.0);
  auto fc = layer(9);
  auto plain = layer(9);
  plan::apply_plan(*fc, one_layer_plan(LayerFormat::kFloat16));
  const auto sum_backward = [&](torch::nn::Linear& l, Region region, bool autocast) {
    l->zero_grad();
    {
      AutocastGuard guard(torch::kCPU, torch::kBFloat16, autocast);
      fp8::Fp8AutocastGuard fp8(region == Region::kPlan);
      (l->forward(x).to(torch::kFloat).sum() * 0.3).backward();
    }
    return l->weight.grad().clone();
  };
  const auto half = sum_backward(fc, Region::kPlan, true);
  const auto float32 = sum_backward(plain, Region::kNone, false);
  EXPECT_GT(float32.abs().max().item<double>(), 65504.0);
  EXPECT_TRUE(torch::isfinite(half).all().item<bool>());
  EXPECT_LT(relative_error(half, float32), 2e-3);

  const auto none = torch::zeros({0, 64}, torch::requires_grad());
  fc->zero_grad();
  {
    AutocastGuard guard(torch::kCPU, torch::kBFloat16);
    fp8::Fp8AutocastGuard fp8;
    fc->forward(none).to(torch::kFloat).sum().backward();
  }
  EXPECT_TRUE(torch::equal(fc->weight.grad(), torch::zeros_like(fc->weight)));
  EXPECT_EQ(none.grad().sizes(), none.sizes());

  // No outputs: an empty output, and zero gradients for the input.
  torch::nn::Linear empty(64, 0);
  plan::apply_plan(*empty, one_layer_plan(LayerFormat::kFloat16));
  const auto xs = torch::randn({4, 3, 64}, torch::requires_grad());
  torch::Tensor y;
  {
    AutocastGuard guard(torch::kCPU, torch::kBFloat16);
    fp8::Fp8AutocastGuard fp8;
    y = empty->forward(xs);
  }
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{4, 3, 0}));
  y.to(torch::kFloat).sum().backward();
  EXPECT_TRUE(torch::equal(xs.grad(), torch::zeros_like(xs)));
}

// The watch compares an fp16 layer's gradient with bf16's: half the inputs
// 1e-13 of the others (a span of 2^43, beyond float16's 2^40 from its
// largest value to its smallest subnormal, within bfloat16's) reach the
// layer as zeros, whatever the scale, so half its weight gradient is zero
// where bf16's is not: reported as underflow, and widen moves the layer to
// fp32, whose gradient is then float32's bit for bit.
TEST(PlanFormatsTest, WatchMovesAnFp16LayerWhoseRangeFlushesItsInputToFp32) {
  torch::manual_seed(5);
  auto x = torch::randn({128, 64});
  x.narrow(1, 0, 32).mul_(1e-13);
  auto fc = layer(6);
  auto plain = layer(6);
  plan::apply_plan(*fc, one_layer_plan(LayerFormat::kFloat16));
  plan::PlanWatch watch(*fc, one_layer_plan(LayerFormat::kFloat16),
                        plan::WatchOptions().every(1).widen(true));
  const auto check = [&](int64_t step) {
    run(fc, x, 1.0, Region::kPlan);
    return watch.check(step, [&] {
      AutocastGuard guard(torch::kCPU, torch::kBFloat16);
      fc->forward(x).to(torch::kFloat).pow(2).mean().backward();
    });
  };
  const auto events = check(0);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].finding, plan::WatchFinding::kUnderflow);
  EXPECT_GT(events[0].underflow, 0.45);
  EXPECT_EQ(events[0].moved_to, LayerFormat::kFloat32);
  EXPECT_THAT(events[0].message(), HasSubstr("(fp16) underflow"));
  EXPECT_EQ(watch.plan().layers[0].format, LayerFormat::kFloat32);
  EXPECT_EQ(watch.plan().layers[0].scale_rule, plan::scale_rule_of(LayerFormat::kFloat32));
  EXPECT_TRUE(check(1).empty());  // fp32: as wide as the comparison, or wider
  const Pass moved = run(fc, x, 1.0, Region::kPlan);
  const Pass float32 = run(plain, x, 1.0, Region::kNone, /*autocast=*/false);
  EXPECT_TRUE(torch::equal(moved.dw, float32.dw));
}

// On CUDA the wide layers run PyTorch's own products (cuBLAS's float32 and
// half GEMMs): the same values as the CPU's up to the sums' order, for the
// output and both gradients, and the fp16 layer's scale keeps gradients of
// a loss scaled by 1e-12 (all below float16's smallest subnormal) there too.
TEST(PlanFormatsTest, CudaWideLayersAreTheCpusUpToTheSumsOrder) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "CUDA not available";
  torch::manual_seed(11);
  const auto x = torch::randn({256, 64});
  for (const LayerFormat format : {LayerFormat::kFloat32, LayerFormat::kFloat16}) {
    for (const double loss_scale : {1.0, 1e-12}) {
      SCOPED_TRACE(plan::to_string(format) + " x " + std::to_string(loss_scale));
      std::vector<Pass> passes;
      for (const c10::DeviceType device : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
        auto fc = layer(12);
        fc->to(device);
        plan::apply_plan(*fc, one_layer_plan(format));
        const auto xd = x.to(device).requires_grad_(true);
        torch::Tensor y;
        {
          AutocastGuard guard(device, torch::kBFloat16);
          fp8::Fp8AutocastGuard fp8;
          y = fc->forward(xd);
        }
        (y.to(torch::kFloat).pow(2).mean() * loss_scale).backward();
        passes.push_back({y.detach().cpu(), xd.grad().cpu(), fc->weight.grad().cpu(),
                          fc->bias.grad().cpu()});
      }
      const double bound = format == LayerFormat::kFloat32 ? 1e-5 : 1e-3;
      EXPECT_EQ(passes[1].y.scalar_type(), torch::kFloat);
      EXPECT_LT(relative_error(passes[1].y, passes[0].y), bound);
      EXPECT_LT(relative_error(passes[1].dx, passes[0].dx), bound);
      EXPECT_LT(relative_error(passes[1].dw, passes[0].dw), bound);
      EXPECT_LT(relative_error(passes[1].db, passes[0].db), bound);
    }
  }
}

// The formats' names, order and rules; a wide layer takes no FP8 recipe.
TEST(PlanFormatsTest, WideFormatsAreNamedAndOrderedWidestFirst) {
  const auto all = plan::all_layer_formats();
  ASSERT_EQ(all.size(), 7u);
  EXPECT_EQ(all[0], LayerFormat::kFloat32);
  EXPECT_EQ(all[1], LayerFormat::kFloat16);
  EXPECT_EQ(all[2], LayerFormat::kBFloat16);
  EXPECT_EQ(plan::parse_layer_format("fp32"), LayerFormat::kFloat32);
  EXPECT_EQ(plan::to_string(LayerFormat::kFloat16), "fp16");
  EXPECT_EQ(plan::wider_format(LayerFormat::kFloat16, "b200"), LayerFormat::kFloat32);
  EXPECT_EQ(plan::wider_format(LayerFormat::kFloat32, "b200"), LayerFormat::kFloat32);
  EXPECT_EQ(plan::wider_format(LayerFormat::kFp8Block, "b200"), LayerFormat::kBFloat16);
  EXPECT_THAT(test::error_text([] { (void)plan::recipe_of(LayerFormat::kFloat16); }),
              HasSubstr("format fp16 has no FP8 recipe (a wide product runs it)"));
  const auto h100 = plan::cost_model_for("h100");
  EXPECT_DOUBLE_EQ(h100.throughput.at(LayerFormat::kFloat16), 1.0);
  EXPECT_NEAR(h100.throughput.at(LayerFormat::kFloat32), 67.0 / 989.0, 1e-12);
  EXPECT_NEAR(plan::cost_model_for("b200").throughput.at(LayerFormat::kFloat32), 1.0 / 30, 1e-12);
  auto fc = layer(7);
  plan::apply_plan(*fc, one_layer_plan(LayerFormat::kFloat16));
  EXPECT_THAT(test::error_text([&] {
                fp8::reconvert_linear(*fc, fp8::Recipe(fp8::CurrentScaling()));
              }),
              HasSubstr("runs a wide product, not an FP8 recipe"));
  fp8::reconvert_linear(*fc, c10::nullopt);  // back to a plain Linear
  auto plain = layer(7);
  const auto x = torch::randn({16, 64});
  EXPECT_TRUE(torch::equal(run(fc, x, 1.0, Region::kPlan).dw,
                           run(plain, x, 1.0, Region::kPlan).dw));
}

}  // namespace
}  // namespace plan_formats_test
}  // namespace ampx
