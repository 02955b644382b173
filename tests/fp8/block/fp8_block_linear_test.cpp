// An FP8 layer under each block-scaled recipe (ampx/fp8/block_recipe.h):
// forward and backward as the recipe's block-scaled products, NVFP4's
// stochastic rounding reproducible across a save and load, training that
// follows float32, and CUDA against the CPU up to the sums' order.

#include "ampx/fp8/block.h"
#include "ampx/fp8/linear.h"

#include "../../test_util.h"

#include <torch/torch.h>

#include <cmath>
#include <sstream>
#include <utility>
#include <vector>

namespace ampx {
namespace fp8 {
namespace {

std::vector<Recipe> block_recipes() {
  return {MXFP8BlockScaling(),
          MXFP8BlockScaling().fp8_format(RecipeFormat::kHybrid).weight_2d(true),
          NVFP4BlockScaling(),
          NVFP4BlockScaling().weight_2d(false).stochastic_rounding(false).random_hadamard(false),
          Float8BlockScaling(),
          Float8BlockScaling().power_2_scale(false).block(64)};
}

double cosine(const at::Tensor& a, const at::Tensor& b) {
  const auto a64 = a.to(torch::kDouble).flatten(), b64 = b.to(torch::kDouble).flatten();
  return (a64.dot(b64) / (a64.norm() * b64.norm())).item<double>();
}

// Each product is block_scaled_mm of its operands quantized as the recipe
// says (the wiring), and near float32's (the arithmetic).
TEST(BlockLinearTest, ForwardAndBackwardAreTheRecipesBlockScaledProducts) {
  for (const Recipe& recipe : block_recipes()) {
    SCOPED_TRACE(recipe.to_string());
    torch::manual_seed(3);
    Linear fc(LinearOptions(128, 256).recipe(recipe).output_dtype(torch::kFloat));
    const auto x = torch::randn({4, 64, 128}, torch::requires_grad());
    at::Tensor y;
    {
      Fp8AutocastGuard fp8;
      y = fc->forward(x);
    }
    const auto g = torch::randn_like(y);
    y.backward(g);
    const auto ref_y =
        torch::nn::functional::linear(x.detach(), fc->weight.detach(), fc->bias.detach());
    const auto ref_gx = g.reshape({-1, 256}).mm(fc->weight.detach()).view(x.sizes());
    const auto ref_gw = g.reshape({-1, 256}).t().mm(x.detach().reshape({-1, 128}));
    const bool fp4 = recipe.kind() == Recipe::Kind::kNvfp4;
    EXPECT_GT(cosine(y, ref_y), fp4 ? 0.98 : 0.999);
    EXPECT_GT(cosine(x.grad(), ref_gx), fp4 ? 0.97 : 0.998);
    EXPECT_GT(cosine(fc->weight.grad(), ref_gw), fp4 ? 0.97 : 0.998);
    EXPECT_TRUE(torch::allclose(fc->bias.grad(), g.reshape({-1, 256}).sum(0), 1e-4, 1e-4));
  }
  // The forward product, composed by hand for MXFP8: the same float32 bits.
  torch::manual_seed(4);
  Linear fc(
      LinearOptions(64, 32).bias(false).recipe(MXFP8BlockScaling()).output_dtype(torch::kFloat));
  const auto x = torch::randn({32, 64});
  at::Tensor y;
  {
    Fp8AutocastGuard fp8;
    y = fc->forward(x);
  }
  const auto want =
      block_scaled_mm(BlockTensor::quantize(x, BlockFormat::mxfp8()),
                      BlockTensor::quantize(fc->weight.detach(), BlockFormat::mxfp8()));
  EXPECT_TRUE(torch::equal(y, want));
}

TEST(BlockLinearTest, Nvfp4StochasticRoundingIsReproducibleAndResumes) {
  const auto run = [](int64_t seed, int steps, Linear* out = nullptr) {
    torch::manual_seed(5);
    Linear fc(
        LinearOptions(64, 64).recipe(NVFP4BlockScaling().seed(seed)).output_dtype(torch::kFloat));
    const auto x = torch::randn({32, 64});
    at::Tensor grads;
    for (int s = 0; s < steps; ++s) {
      fc->zero_grad();
      Fp8AutocastGuard fp8;
      fc->forward(x).square().sum().backward();
      grads = fc->weight.grad().clone();
    }
    if (out) *out = fc;
    return grads;
  };
  Linear a{nullptr};
  const auto g1 = run(0, 2, &a);
  EXPECT_TRUE(torch::equal(g1, run(0, 2))) << "same seed, same model: the same gradients";
  EXPECT_FALSE(torch::equal(g1, run(1, 2))) << "another seed draws other roundings";
  // Two backwards of 32 x 64 gradients, rows and columns: 4 * 2048 numbers.
  const auto buffers = a->named_buffers();
  ASSERT_TRUE(buffers.contains("rounding"));
  EXPECT_EQ(buffers["rounding"][1].item<int64_t>(), 4 * 32 * 64);
  EXPECT_FALSE(torch::equal(run(0, 1), g1)) << "each step draws new numbers";
  // Saved and loaded, the stream goes on where it stopped.
  std::stringstream archive;
  torch::save(a, archive);
  torch::manual_seed(99);
  Linear b(LinearOptions(64, 64).recipe(NVFP4BlockScaling()).output_dtype(torch::kFloat));
  torch::load(b, archive);
  EXPECT_TRUE(torch::equal(b->named_buffers()["rounding"], buffers["rounding"]));
}

// A small regression trained under each recipe reaches float32's loss
// within the recipe's precision: the layers learn through the emulation.
TEST(BlockLinearTest, TrainingUnderEachRecipeFollowsFloat32) {
  const auto train = [](const c10::optional<Recipe>& recipe) {
    torch::manual_seed(6);
    torch::nn::Sequential net(torch::nn::Linear(64, 128), torch::nn::GELU(),
                              torch::nn::Linear(128, 64));
    if (recipe) convert_linears(*net, ConvertOptions().recipe(*recipe).output_dtype(torch::kFloat));
    const auto target_map = torch::randn({64, 64}) / 8;
    torch::optim::Adam opt(net->parameters(), 1e-2);
    double loss = 0;
    for (int step = 0; step < 150; ++step) {
      const auto x = torch::randn({64, 64});
      opt.zero_grad();
      Fp8AutocastGuard fp8;
      const auto l = torch::mse_loss(net->forward(x), x.mm(target_map));
      fp8.finish();
      l.backward();
      opt.step();
      loss = l.item<double>();
    }
    return loss;
  };
  const double fp32 = train(c10::nullopt);
  const double start = 1.0;  // the target's variance: 64 x (1/8)^2
  EXPECT_LT(fp32, start / 20);
  for (const Recipe& recipe : block_recipes()) {
    const double loss = train(recipe);
    // FP4 loses more: within 4x float32's loss here, FP8's within 2x.
    const bool fp4 = recipe.kind() == Recipe::Kind::kNvfp4;
    EXPECT_LT(loss, (fp4 ? 4 : 2) * fp32) << recipe.to_string() << " (fp32 " << fp32 << ")";
  }
}

// A CUDA layer against the CPU's: the same codes and scales (BlockCudaTest),
// the products' float32 sums in another order (cuBLAS's, from dequantized
// blocks). A float32 sum of K products differs from another order's by at
// most 2 K 2^-24 sum |a_k b_k| <= 2 K 2^-24 |a| |b| (Cauchy-Schwarz), a and
// b the quantized rows (and through NVFP4's Hadamard transform, orthogonal:
// their norms kept); the bound taken, K 2^-20 |a| |b| of the unquantized
// rows, leaves a factor 8 for the quantization's growth of the norms.
at::Tensor sum_order_bound(const at::Tensor& a, const at::Tensor& b) {
  const auto na = a.to(torch::kDouble).norm(2, {1}, true);
  const auto nb = b.to(torch::kDouble).norm(2, {1}, true);
  return na.mm(nb.t()) * (static_cast<double>(a.size(1)) * std::ldexp(1.0, -20));
}

// |got - want| within `bound`, plus 2^-22 |want| for the roundings after the
// sum (the bias added, the tensor scale multiplied).
void expect_within(const at::Tensor& got, const at::Tensor& want, const at::Tensor& sum_bound,
                   const char* what) {
  const auto w = want.to(torch::kDouble).view(sum_bound.sizes());
  const auto bound = sum_bound + w.abs() * std::ldexp(1.0, -22);
  const auto diff = (got.cpu().to(torch::kDouble).view(sum_bound.sizes()) - w).abs();
  EXPECT_TRUE(diff.le(bound).all().item<bool>())
      << what << ": largest difference " << diff.max().item<double>() << ", its bound "
      << bound.view(-1)[diff.view(-1).argmax()].item<double>();
}

TEST(BlockLinearTest, CudaForwardAndBackwardAreTheCpusUpToTheSumsOrder) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "CUDA not available";
  for (const Recipe& recipe : block_recipes()) {
    SCOPED_TRACE(recipe.to_string());
    torch::manual_seed(3);
    Linear cpu(LinearOptions(128, 256).recipe(recipe).output_dtype(torch::kFloat));
    torch::manual_seed(3);
    Linear gpu(LinearOptions(128, 256).recipe(recipe).output_dtype(torch::kFloat));
    gpu->to(torch::kCUDA);
    const auto x = torch::randn({4, 64, 128});
    const auto g = torch::randn({4, 64, 256});
    const auto run = [&](Linear& fc, const at::Tensor& input, const at::Tensor& grad) {
      const auto xi = input.clone().requires_grad_(true);
      at::Tensor y;
      {
        Fp8AutocastGuard fp8;
        y = fc->forward(xi);
      }
      y.backward(grad);
      return std::make_pair(y.detach(), xi.grad());
    };
    const auto [want_y, want_gx] = run(cpu, x, g);
    const auto [got_y, got_gx] = run(gpu, x.cuda(), g.cuda());
    ASSERT_TRUE(got_y.is_cuda() && gpu->weight.grad().is_cuda());
    const auto x2 = x.view({-1, 128}), g2 = g.view({-1, 256}), w = cpu->weight.detach();
    expect_within(got_y, want_y, sum_order_bound(x2, w), "y");
    expect_within(got_gx.view({-1, 128}), want_gx.view({-1, 128}), sum_order_bound(g2, w.t()),
                  "grad x");
    expect_within(gpu->weight.grad(), cpu->weight.grad(), sum_order_bound(g2.t(), x2.t()),
                  "grad w");
    EXPECT_TRUE(torch::allclose(gpu->bias.grad().cpu(), cpu->bias.grad(), 1e-5, 1e-5));
    // The stochastic stream moved on the device as on the CPU.
    for (const auto& item : cpu->named_buffers()) {
      EXPECT_TRUE(gpu->named_buffers()[item.key()].cpu().equal(item.value())) << item.key();
    }
  }
}

}  // namespace
}  // namespace fp8
}  // namespace ampx
