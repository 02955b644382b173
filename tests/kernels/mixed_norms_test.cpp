// The mixed-precision norms and activation (ampx/kernels.h): LayerNorm,
// BatchNorm and GELU on 16-bit tensors with float32 statistics, every ISA
// build against float64 and ATen's own kernels, independent of the thread
// count, and run by O2's modules.

#include "ampx/detail/kernels.h"
#include "ampx/kernels.h"
#include "ampx/policy.h"
#include "ampx/version.h"

#include "../test_util.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>

namespace {

using ::testing::HasSubstr;

}  // namespace

// ---- mixed_layer_norm: 16-bit LayerNorm with float32 statistics ------------

namespace {

// One bf16/fp16 ulp at |v| (the spacing of the format around v).
torch::Tensor ulp(const torch::Tensor& v, torch::ScalarType dtype) {
  const int mantissa = dtype == torch::kBFloat16 ? 7 : 10;
  const double min_exp = dtype == torch::kBFloat16 ? -126 : -14;
  auto e = torch::floor(torch::log2(v.abs().clamp_min(1e-30))).clamp_min(min_exp);
  return torch::pow(2.0, e - mantissa);
}

// Rows or channels whose variance is at or below eps, where eps decides a
// norm's result (padding, a saturated activation, a zero-initialised layer's
// output): kind 1 zeros, 2 a constant, 3 and 4 nearly constant with variance
// about eps / 4 and eps (around 2 sqrt(eps)). A norm that adds eps in the
// wrong place (1 / (sqrt(var) + eps)) is off there by thousands of ulps.
constexpr int kFlatKinds = 5;  // kind 0: no change (random values)
torch::Tensor flat_values(int kind, at::IntArrayRef shape, double eps) {
  const double sd = std::sqrt(eps);
  switch (kind) {
    case 1:
      return torch::zeros(shape);
    case 2:
      return torch::full(shape, 0.75);
    case 3:
      return sd * (2 + 0.5 * torch::randn(shape));
    default:
      return sd * (2 + torch::randn(shape));
  }
}

// Each row's largest |v| at every element of the row: the scale of a sum
// over the row, whose rounding a tolerance may allow for.
torch::Tensor row_scale(const torch::Tensor& v, int64_t n) {
  const auto rows = v.reshape({-1, n});
  return rows.abs().amax(1, /*keepdim=*/true).expand_as(rows).reshape(v.sizes());
}

struct LnCase {
  std::vector<int64_t> x_shape;
  std::vector<int64_t> normalized;
  torch::ScalarType dtype;
  bool affine;
  double eps = 1e-5;  // the default
};

// The float64 LayerNorm of x's exact values, and its gradients for dy.
struct LnReference {
  torch::Tensor y, dx, dw, db;
};
LnReference reference_layer_norm(const torch::Tensor& x, const std::vector<int64_t>& shape,
                                 const torch::Tensor& w, const torch::Tensor& b,
                                 const torch::Tensor& dy, double eps) {
  auto xd = x.to(torch::kDouble).detach().requires_grad_(true);
  torch::Tensor wd, bd;
  if (w.defined()) wd = w.to(torch::kDouble).detach().requires_grad_(true);
  if (b.defined()) bd = b.to(torch::kDouble).detach().requires_grad_(true);
  auto y = torch::layer_norm(xd, shape, wd, bd, eps);
  y.backward(dy.to(torch::kDouble));
  return {y.detach(), xd.grad(), wd.defined() ? wd.grad() : torch::Tensor(),
          bd.defined() ? bd.grad() : torch::Tensor()};
}

}  // namespace

// Forward and all gradients against float64: y and dx within one ulp of the
// 16-bit format (plus what float32 statistics add, relative to the row's
// largest dx), dweight and dbias within float32 rounding of sums over the
// rows. Shapes with a vector tail, several normalized dims, no affine
// parameters; bf16 and fp16; the default eps and others; every fifth row
// random and the others at or below eps in variance (flat_values).
TEST(MixedLayerNormTest, ForwardAndGradientsMatchFloat64WithinOneUlp) {
  const std::vector<LnCase> cases = {{{4, 7, 256}, {256}, torch::kBFloat16, true},
                                     {{3, 37}, {37}, torch::kBFloat16, true},
                                     {{2, 3, 4, 5}, {4, 5}, torch::kBFloat16, true},
                                     {{5, 48}, {48}, torch::kBFloat16, false},
                                     {{6, 64}, {64}, torch::kHalf, true},
                                     {{10, 40}, {40}, torch::kBFloat16, true, 1e-3},
                                     {{5, 2, 24}, {24}, torch::kHalf, false, 1e-6},
                                     {{2, 5, 3, 7}, {3, 7}, torch::kHalf, true, 1e-2}};
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::PrintToString(c.x_shape) + " " + std::string(c10::toString(c.dtype)) +
                 " eps " + std::to_string(c.eps));
    torch::manual_seed(11);
    auto x0 = torch::randn(c.x_shape) * 3 + 1.5;
    int64_t n = 1;
    for (const int64_t d : c.normalized) n *= d;
    const auto rows = x0.view({-1, n});
    for (int64_t r = 0; r < rows.size(0); ++r) {
      if (r % kFlatKinds != 0) rows[r].copy_(flat_values(r % kFlatKinds, {n}, c.eps));
    }
    const auto x = x0.to(c.dtype).requires_grad_(true);
    torch::Tensor w, b;
    if (c.affine) {
      w = (torch::randn(c.normalized) * 0.5 + 1).requires_grad_(true);
      b = (torch::randn(c.normalized) * 0.1).requires_grad_(true);
    }
    ASSERT_TRUE(ampx::mixed_layer_norm_is_fused(x, c.normalized, w, b));
    // The default eps as a caller gets it: by leaving it out.
    const auto y = c.eps == 1e-5 ? ampx::mixed_layer_norm(x, c.normalized, w, b)
                                 : ampx::mixed_layer_norm(x, c.normalized, w, b, c.eps);
    ASSERT_EQ(y.scalar_type(), c.dtype);
    const auto dy = torch::randn(c.x_shape).to(c.dtype);
    y.backward(dy);
    ASSERT_EQ(x.grad().scalar_type(), c.dtype);
    const auto ref = reference_layer_norm(x.detach(), c.normalized, w, b, dy, c.eps);
    const auto y_err = (y.to(torch::kDouble) - ref.y).abs();
    EXPECT_TRUE((y_err <= ulp(ref.y, c.dtype) + 1e-6).all().item<bool>())
        << "y off by up to " << (y_err / ulp(ref.y, c.dtype)).max().item<double>() << " ulp";
    const auto dx_err = (x.grad().to(torch::kDouble) - ref.dx).abs();
    EXPECT_TRUE((dx_err <= ulp(ref.dx, c.dtype) + 1e-5 * row_scale(ref.dx, n)).all().item<bool>())
        << "dx off by up to " << (dx_err / ulp(ref.dx, c.dtype)).max().item<double>() << " ulp";
    if (c.affine) {
      ASSERT_EQ(w.grad().scalar_type(), torch::kFloat);
      EXPECT_TRUE(torch::allclose(w.grad().to(torch::kDouble), ref.dw, 1e-5, 1e-4));
      EXPECT_TRUE(torch::allclose(b.grad().to(torch::kDouble), ref.db, 1e-5, 1e-4));
    }
  }
}

// Against the composite it replaces (O2's fp32 norm: cast in, float32
// layer_norm, cast out) and, on LibTorch 2.x, PyTorch's own mixed-dtype
// CPU layer_norm: at most one bf16 ulp apart, almost everywhere equal.
TEST(MixedLayerNormTest, AgreesWithTheFloat32CompositeAndPyTorchsOwnKernel) {
  torch::manual_seed(12);
  const auto x = (torch::randn({64, 128, 256}) * 2).to(torch::kBFloat16);
  const auto w = torch::randn({256}) * 0.3 + 1, b = torch::randn({256}) * 0.1;
  const auto fused = ampx::mixed_layer_norm(x, {256}, w, b);
  auto compare = [&](const torch::Tensor& other, const char* what) {
    const auto diff = (fused.to(torch::kFloat) - other.to(torch::kFloat)).abs();
    // One ulp, or float32 rounding of the statistics where y is near 0.
    const auto one_ulp = ulp(other.to(torch::kFloat).to(torch::kDouble), torch::kBFloat16) + 1e-5;
    EXPECT_TRUE((diff.to(torch::kDouble) <= one_ulp).all().item<bool>())
        << what << ": up to " << (diff.to(torch::kDouble) / one_ulp).max().item<double>();
    const double differ = (diff > 0).to(torch::kDouble).mean().item<double>();
    EXPECT_LT(differ, 0.01) << what << ": " << differ * 100 << "% of elements differ";
  };
  compare(at::layer_norm(x.to(torch::kFloat), {256}, w, b, 1e-5).to(torch::kBFloat16),
          "the float32 composite");
  if (std::string(ampx::torch_version()).rfind("1.", 0) != 0) {
    compare(at::layer_norm(x, {256}, w, b, 1e-5), "PyTorch's bf16 CPU layer_norm");
  }
}

// The same bits on one thread as on two: rows are independent, and the
// weight and bias gradients sum fixed blocks of rows in a fixed order.
TEST(MixedLayerNormTest, ResultsDoNotDependOnTheThreadCount) {
  torch::manual_seed(13);
  const auto x0 = torch::randn({300, 96}).to(torch::kBFloat16);
  const auto dy = torch::randn({300, 96}).to(torch::kBFloat16);
  auto run = [&](int threads) {
    at::set_num_threads(threads);
    auto x = x0.clone().requires_grad_(true);
    auto w = torch::ones({96}).requires_grad_(true), b = torch::zeros({96}).requires_grad_(true);
    auto y = ampx::mixed_layer_norm(x, {96}, w, b);
    y.backward(dy);
    return std::vector<torch::Tensor>{y.detach(), x.grad(), w.grad(), b.grad()};
  };
  const int before = at::get_num_threads();
  const auto one = run(1), two = run(2);
  at::set_num_threads(before);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(torch::equal(one[i], two[i])) << i;
}

// O2's norms take the fused kernel: a LayerNorm module under
// KeepNormsFp32Guard returns bf16 from ampx's function (not a cast of a
// float32 result), and saves the bf16 input, not a float32 copy.
TEST(MixedLayerNormTest, O2NormsRunTheFusedKernel) {
  torch::manual_seed(14);
  torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({64}));
  const auto x = torch::randn({8, 64}).to(torch::kBFloat16).requires_grad_(true);
  torch::Tensor y;
  {
    ampx::KeepNormsFp32Guard guard(torch::kCPU);
    y = ln->forward(x);
  }
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_THAT(y.grad_fn()->name(), HasSubstr("MixedLayerNorm"));
  EXPECT_TRUE(torch::equal(y, ampx::mixed_layer_norm(x, {64}, ln->weight, ln->bias)));
  y.sum().backward();
  EXPECT_EQ(ln->weight.grad().scalar_type(), torch::kFloat);
  EXPECT_EQ(x.grad().scalar_type(), torch::kBFloat16);
  // Not fused: float32 input, or bf16 weights (O3) -> the composite.
  EXPECT_FALSE(ampx::mixed_layer_norm_is_fused(x.to(torch::kFloat), {64}, ln->weight, ln->bias));
  EXPECT_FALSE(ampx::mixed_layer_norm_is_fused(x, {64}, ln->weight.to(torch::kBFloat16), {}));
}

// ---- mixed_batch_norm: 16-bit batch norm with float32 statistics -----------

// Training and evaluation, forward and gradients, against float64 batch norm
// of the same values; the running statistics as ATen's float32 batch norm
// updates them (momentum, unbiased variance). The default eps and another;
// channel 0 random, channels 1 to 4 at or below eps in variance
// (flat_values), and in evaluation their running variances 0, eps / 10, eps
// and 0.
TEST(MixedBatchNormTest, MatchesFloat64AndUpdatesRunningStatisticsAsAtenDoes) {
  for (const double eps : {1e-5, 1e-3}) {
    for (const bool training : {true, false}) {
      for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
        SCOPED_TRACE(std::string(training ? "training " : "eval ") + c10::toString(dtype) +
                     " eps " + std::to_string(eps));
        torch::manual_seed(21);
        auto x0 = torch::randn({6, 5, 7, 9}) * 2 + 0.5;
        for (int c = 1; c < kFlatKinds; ++c) {
          x0.select(1, c).copy_(flat_values(c, {6, 7, 9}, eps));
        }
        const auto x = x0.to(dtype).requires_grad_(true);
        const auto w = (torch::randn({5}) * 0.3 + 1).requires_grad_(true);
        const auto b = (torch::randn({5}) * 0.2).requires_grad_(true);
        const auto rm0 = torch::randn({5}) * 0.1;
        auto rv0 = torch::rand({5}) + 0.5;
        rv0.slice(0, 1).copy_(torch::tensor({0.0, eps / 10, eps, 0.0}));
        auto rm = rm0.clone(), rv = rv0.clone();
        ASSERT_TRUE(ampx::mixed_batch_norm_is_fused(x, w, b, rm, rv, training));
        // The default eps as a caller gets it: by leaving it out.
        const auto y = eps == 1e-5 ? ampx::mixed_batch_norm(x, w, b, rm, rv, training)
                                   : ampx::mixed_batch_norm(x, w, b, rm, rv, training, 0.1, eps);
        ASSERT_EQ(y.scalar_type(), dtype);
        const auto dy = torch::randn(x.sizes()).to(dtype);
        y.backward(dy);

        auto xd = x.detach().to(torch::kDouble).requires_grad_(true);
        auto wd = w.detach().to(torch::kDouble).requires_grad_(true);
        auto bd = b.detach().to(torch::kDouble).requires_grad_(true);
        auto rmd = rm0.to(torch::kDouble), rvd = rv0.to(torch::kDouble);
        const auto yd = torch::batch_norm(xd, wd, bd, rmd, rvd, training, 0.1, eps, false);
        yd.backward(dy.to(torch::kDouble));
        const auto y_err = (y.to(torch::kDouble) - yd).abs();
        EXPECT_TRUE((y_err <= ulp(yd, dtype) + 1e-5).all().item<bool>())
            << "y off by up to " << (y_err / ulp(yd, dtype)).max().item<double>() << " ulp";
        // Float32 rounding relative to the channel's largest dx.
        const auto dx_err = (x.grad().to(torch::kDouble) - xd.grad()).abs();
        const auto dx_scale = row_scale(xd.grad().transpose(0, 1).contiguous(), 6 * 7 * 9);
        EXPECT_TRUE(
            (dx_err <= ulp(xd.grad(), dtype) + 1e-4 * dx_scale.transpose(0, 1)).all().item<bool>())
            << "dx off by up to " << (dx_err / ulp(xd.grad(), dtype)).max().item<double>()
            << " ulp";
        EXPECT_TRUE(torch::allclose(w.grad().to(torch::kDouble), wd.grad(), 1e-5, 1e-3));
        EXPECT_TRUE(torch::allclose(b.grad().to(torch::kDouble), bd.grad(), 1e-5, 1e-3));
        // Running statistics: as ATen's float32 batch norm of the same values.
        auto rm32 = rm0.clone(), rv32 = rv0.clone();
        (void)torch::batch_norm(x.detach().to(torch::kFloat), w.detach(), b.detach(), rm32, rv32,
                                training, 0.1, eps, false);
        EXPECT_TRUE(torch::allclose(rm, rm32, 1e-5, 1e-6)) << rm << rm32;
        EXPECT_TRUE(torch::allclose(rv, rv32, 1e-5, 1e-6)) << rv << rv32;
        if (!training) {
          EXPECT_TRUE(torch::equal(rm, rm0));
        }
      }
    }
  }
}

// O2's batch norm takes the fused kernel; one thread or two, the same bits.
TEST(MixedBatchNormTest, O2BatchNormRunsTheFusedKernelWhateverTheThreads) {
  torch::manual_seed(22);
  const auto x0 = torch::randn({8, 16, 14, 14}).to(torch::kBFloat16);
  const auto dy = torch::randn({8, 16, 14, 14}).to(torch::kBFloat16);
  auto run = [&](int threads) {
    at::set_num_threads(threads);
    torch::manual_seed(23);
    torch::nn::BatchNorm2d bn(16);
    auto x = x0.clone().requires_grad_(true);
    torch::Tensor y;
    {
      ampx::KeepNormsFp32Guard guard(torch::kCPU);
      y = bn->forward(x);
    }
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    EXPECT_THAT(y.grad_fn()->name(), HasSubstr("MixedBatchNorm"));
    y.backward(dy);
    return std::vector<torch::Tensor>{y.detach(), x.grad(), bn->weight.grad(), bn->bias.grad(),
                                      bn->running_mean, bn->running_var};
  };
  const int before = at::get_num_threads();
  const auto one = run(1), two = run(2);
  at::set_num_threads(before);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(torch::equal(one[i], two[i])) << i;
  EXPECT_FALSE(ampx::mixed_batch_norm_is_fused(x0, {}, {}, {}, {}, /*training=*/false));
}

// ---- mixed_gelu: exact GELU of 16-bit activations in float32 math --------

namespace {

// GELU and its derivative of x's exact values in float64.
std::pair<torch::Tensor, torch::Tensor> reference_gelu(const torch::Tensor& x) {
  const auto xd = x.to(torch::kDouble);
  const auto cdf = 0.5 * (1 + torch::erf(xd * M_SQRT1_2));
  const auto pdf = torch::exp(-0.5 * xd * xd) / std::sqrt(2 * M_PI);
  return {xd * cdf, cdf + xd * pdf};
}

}  // namespace

// Every instruction-set build, bf16 and fp16, a size with a partial block
// (1024 elements) and a vector tail, inputs out to +-15: y and dx within one
// ulp of the 16-bit format of float64's, plus float32's rounding near zero.
TEST(MixedGeluTest, EveryIsaMatchesFloat64WithinOneUlpForwardAndBackward) {
  for (const auto isa : ampx::detail::cpu::supported_isas()) {
    for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
      SCOPED_TRACE(ampx::detail::cpu::isa_name(isa) + " " + c10::toString(dtype));
      torch::manual_seed(31);
      const auto x = (torch::randn({3, 1031}) * 3).clamp(-15, 15).to(dtype).requires_grad_(true);
      const auto y = ampx::detail::cpu::mixed_gelu(x, isa);
      ASSERT_EQ(y.scalar_type(), dtype);
      const auto dy = torch::randn({3, 1031}).to(dtype);
      y.backward(dy);
      ASSERT_EQ(x.grad().scalar_type(), dtype);
      const auto ref = reference_gelu(x.detach());
      const auto y_err = (y.to(torch::kDouble) - ref.first).abs();
      const auto y_ulp = ulp(ref.first, dtype) + 1e-6;
      EXPECT_TRUE((y_err <= y_ulp).all().item<bool>())
          << "y off by up to " << (y_err / y_ulp).max().item<double>() << " ulp";
      const auto dx_ref = dy.to(torch::kDouble) * ref.second;
      const auto dx_err = (x.grad().to(torch::kDouble) - dx_ref).abs();
      const auto dx_ulp = ulp(dx_ref, dtype) + 1e-6;
      EXPECT_TRUE((dx_err <= dx_ulp).all().item<bool>())
          << "dx off by up to " << (dx_err / dx_ulp).max().item<double>() << " ulp";
    }
  }
}

// Against what it replaces: ATen's float32 GELU, forward and backward,
// rounded once to bf16 (which is what LibTorch's own bf16 GELU returns). At
// most one bf16 ulp apart, almost everywhere equal: ampx's erf is a
// polynomial, ATen's is SLEEF's (1.13) or its own (2.6), and an output next to
// a rounding boundary can land on either side (1.03% of y on 2.6).
TEST(MixedGeluTest, AgreesWithAtensFloat32GeluRoundedOnce) {
  torch::manual_seed(32);
  const auto x = (torch::randn({64, 1000}) * 2).to(torch::kBFloat16).requires_grad_(true);
  const auto dy = torch::randn({64, 1000}).to(torch::kBFloat16);
  const auto y = ampx::mixed_gelu(x);
  y.backward(dy);
  const auto xf = x.detach().to(torch::kFloat);
  const auto y32 = at::gelu(xf).to(torch::kBFloat16);
  const auto dx32 = at::gelu_backward(dy.to(torch::kFloat), xf).to(torch::kBFloat16);
  for (const auto& [mine, theirs, what] :
       {std::make_tuple(y.detach(), y32, "y"), std::make_tuple(x.grad(), dx32, "dx")}) {
    const auto diff = (mine.to(torch::kDouble) - theirs.to(torch::kDouble)).abs();
    const auto one_ulp = ulp(theirs.to(torch::kDouble), torch::kBFloat16) + 1e-6;
    EXPECT_TRUE((diff <= one_ulp).all().item<bool>())
        << what << ": up to " << (diff / one_ulp).max().item<double>() << " ulp";
    const double differ = (diff > 0).to(torch::kDouble).mean().item<double>();
    EXPECT_LT(differ, 0.02) << what << ": " << differ * 100 << "% of elements differ";
  }
  // float32 and float64 inputs run ATen's GELU as they are.
  EXPECT_FALSE(ampx::mixed_gelu_is_fused(xf));
  EXPECT_TRUE(torch::equal(ampx::mixed_gelu(xf), at::gelu(xf)));
}

// O2 (KeepNormsFp32Guard) runs a bf16 exact GELU through mixed_gelu on the
// CPU; the tanh approximation takes the generic float32 path; outside the
// guard GELU is ATen's.
TEST(MixedGeluTest, O2GeluRunsTheFusedKernel) {
  torch::manual_seed(33);
  const auto x = torch::randn({16, 256}).to(torch::kBFloat16).requires_grad_(true);
  torch::Tensor exact, tanh;
  {
    ampx::KeepNormsFp32Guard guard(torch::kCPU);
    exact = torch::gelu(x);
    tanh = torch::gelu(x, "tanh");
  }
  ASSERT_NE(exact.grad_fn(), nullptr);
  EXPECT_THAT(exact.grad_fn()->name(), HasSubstr("MixedGelu"));
  EXPECT_TRUE(torch::equal(exact, ampx::mixed_gelu(x)));
  EXPECT_EQ(tanh.scalar_type(), torch::kBFloat16);
  EXPECT_THAT(tanh.grad_fn()->name(), ::testing::Not(HasSubstr("MixedGelu")));
  EXPECT_TRUE(torch::equal(tanh, at::gelu(x.to(torch::kFloat), "tanh").to(torch::kBFloat16)));
  const auto outside = torch::gelu(x);
  EXPECT_THAT(outside.grad_fn()->name(), ::testing::Not(HasSubstr("MixedGelu")));
}
