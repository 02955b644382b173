// Wide 16-bit CPU products (ampx::wide_linear, wide_bmm, wide_matmul and
// WideProductsGuard): within one 16-bit rounding of float64 forward and
// backward, one rounding (not two) with a bias, and taken by autocast, O2 and
// O3 where set_cpu_products says so, with the policies restored afterwards.

#include "ampx/amp.h"
#include "ampx/autocast.h"
#include "ampx/kernels.h"
#include "ampx/memory.h"
#include "ampx/optim.h"
#include "ampx/policy.h"

#include "../test_util.h"

#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

namespace {

using ampx::CpuProducts;

// Sets the products mode for a test and restores the one before.
class ProductsMode {
 public:
  explicit ProductsMode(CpuProducts mode) : before_(ampx::get_cpu_products()) {
    ampx::set_cpu_products(mode);
  }
  ~ProductsMode() { ampx::set_cpu_products(before_); }

 private:
  CpuProducts before_;
};

// Float32 accumulation of k products, against float64: off by at most
// k * 2^-24 * sum |a_i b_i| (`magnitude`, the product of the absolute values),
// then rounded once to the 16-bit dtype. Checks, element by element,
// |got - want| <= that error plus the dtype's spacing at |want| + that error;
// want and magnitude are float64.
void expect_within_one_rounding(const torch::Tensor& got, const torch::Tensor& want,
                                const torch::Tensor& magnitude, int64_t k,
                                const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const int mantissa = got.scalar_type() == torch::kBFloat16 ? 7 : 10;
  const double min_normal = got.scalar_type() == torch::kBFloat16 ? std::ldexp(1.0, -126)
                                                                  : std::ldexp(1.0, -14);
  const auto w = want.to(torch::kDouble).contiguous();
  const auto g = got.to(torch::kDouble).contiguous();
  const auto m = magnitude.to(torch::kDouble).expand(want.sizes()).contiguous();
  const double* wp = w.data_ptr<double>();
  const double* gp = g.data_ptr<double>();
  const double* mp = m.data_ptr<double>();
  int64_t bad = 0;
  for (int64_t i = 0; i < w.numel(); ++i) {
    const double accumulation = static_cast<double>(k) * std::ldexp(1.0, -24) * mp[i];
    const double a = std::max(std::fabs(wp[i]) + accumulation, min_normal);
    const double spacing = std::ldexp(1.0, std::ilogb(a) - mantissa);
    if (std::fabs(gp[i] - wp[i]) > spacing + accumulation) {
      if (++bad <= 3) {
        ADD_FAILURE() << what << "[" << i << "]: got " << gp[i] << ", float64 " << wp[i]
                      << " (spacing " << spacing << ", accumulation bound " << accumulation
                      << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << w.numel() << " elements off";
}

torch::Tensor random16(torch::IntArrayRef sizes, torch::ScalarType dtype, bool grad = true) {
  return torch::randn(sizes).to(dtype).requires_grad_(grad);
}

std::string grad_fn_name(const torch::Tensor& t) {
  return t.grad_fn() ? t.grad_fn()->name() : std::string("(none)");
}

class WideProductsTest : public ::testing::TestWithParam<torch::ScalarType> {};

// wide_linear on x [batch, rows, k], w [n, k], b [n]: forward and the three
// gradients each within one rounding of float64.
void expect_linear_within_one_rounding(torch::ScalarType dtype, int64_t batch, int64_t rows,
                                       int64_t k, int64_t n) {
  auto x = random16({batch, rows, k}, dtype), w = random16({n, k}, dtype),
       b = random16({n}, dtype);
  auto y = ampx::wide_linear(x, w, b);
  ASSERT_EQ(y.scalar_type(), dtype);
  ASSERT_EQ(y.sizes(), torch::IntArrayRef({batch, rows, n}));
  const auto x64 = x.detach().to(torch::kDouble), w64 = w.detach().to(torch::kDouble),
             b64 = b.detach().to(torch::kDouble);
  expect_within_one_rounding(y, torch::matmul(x64, w64.t()) + b64,
                             torch::matmul(x64.abs(), w64.abs().t()) + b64.abs(), k + 1, "y");

  const auto g = torch::randn({batch, rows, n}).to(dtype);
  y.backward(g);
  const auto g64 = g.to(torch::kDouble).reshape({-1, n});
  ASSERT_EQ(x.grad().scalar_type(), dtype);
  ASSERT_EQ(w.grad().scalar_type(), dtype);
  ASSERT_EQ(b.grad().scalar_type(), dtype);
  const auto x2 = x64.reshape({-1, k});
  expect_within_one_rounding(x.grad(), torch::mm(g64, w64).view({batch, rows, k}),
                             torch::mm(g64.abs(), w64.abs()).view({batch, rows, k}), n, "dx");
  expect_within_one_rounding(w.grad(), torch::mm(g64.t(), x2), torch::mm(g64.abs().t(), x2.abs()),
                             batch * rows, "dweight");
  expect_within_one_rounding(b.grad(), g64.sum(0), g64.abs().sum(0), batch * rows, "dbias");
}

TEST_P(WideProductsTest, LinearIsWithinOneRoundingOfFloat64ForwardAndBackward) {
  torch::manual_seed(1);
  expect_linear_within_one_rounding(GetParam(), 3, 5, 96, 40);
}

// 2100 rows of k 512 and n 1536 run as four blocks of 512 rows and one of
// 52 (float32 copies of about 4 MiB a block): every row of the output and
// of the input's gradient comes from its block, the weight's and bias's
// gradients are the sums over all five.
TEST_P(WideProductsTest, LinearOverBlocksOfRowsIsWithinOneRoundingOfFloat64) {
  torch::manual_seed(11);
  expect_linear_within_one_rounding(GetParam(), 3, 700, 512, 1536);
}

TEST_P(WideProductsTest, BiasIsAddedBeforeTheOneRounding) {
  torch::manual_seed(2);
  const auto dtype = GetParam();
  const auto x = random16({64, 128}, dtype, false), w = random16({32, 128}, dtype, false);
  // A bias large against the product: rounding the product first and then
  // the sum would lose bits the single rounding keeps.
  const auto b = (torch::randn({32}) * 300).to(dtype);
  const auto want =
      torch::addmm(b.to(torch::kFloat), x.to(torch::kFloat), w.to(torch::kFloat).t()).to(dtype);
  EXPECT_TRUE(torch::equal(ampx::wide_linear(x, w, b), want));
  const auto twice = (torch::mm(x.to(torch::kFloat), w.to(torch::kFloat).t()).to(dtype).to(
                          torch::kFloat) +
                      b.to(torch::kFloat))
                         .to(dtype);
  EXPECT_FALSE(torch::equal(twice, want)) << "the inputs do not tell one rounding from two";
}

TEST_P(WideProductsTest, AttentionShapedMatmulAndBmmAreWithinOneRoundingBothWays) {
  torch::manual_seed(3);
  const auto dtype = GetParam();
  // q [B, H, T, hd] times k transposed, as attention does (a strided view).
  auto q = random16({2, 3, 16, 8}, dtype), k = random16({2, 3, 16, 8}, dtype);
  auto att = ampx::wide_matmul(q, k.transpose(-2, -1));
  ASSERT_EQ(att.sizes(), torch::IntArrayRef({2, 3, 16, 16}));
  const auto q64 = q.detach().to(torch::kDouble), k64 = k.detach().to(torch::kDouble);
  expect_within_one_rounding(att, torch::matmul(q64, k64.transpose(-2, -1)),
                             torch::matmul(q64.abs(), k64.abs().transpose(-2, -1)), 8, "scores");
  const auto g = torch::randn({2, 3, 16, 16}).to(dtype);
  att.backward(g);
  const auto g64 = g.to(torch::kDouble);
  expect_within_one_rounding(q.grad(), torch::matmul(g64, k64),
                             torch::matmul(g64.abs(), k64.abs()), 16, "dq");
  expect_within_one_rounding(k.grad(), torch::matmul(g64.transpose(-2, -1), q64),
                             torch::matmul(g64.abs().transpose(-2, -1), q64.abs()), 16, "dk");

  auto a = random16({4, 7, 12}, dtype), c = random16({4, 12, 5}, dtype);
  auto y = ampx::wide_bmm(a, c);
  const auto a64 = a.detach().to(torch::kDouble), c64 = c.detach().to(torch::kDouble);
  expect_within_one_rounding(y, torch::bmm(a64, c64), torch::bmm(a64.abs(), c64.abs()), 12,
                             "bmm");
  const auto gy = torch::randn({4, 7, 5}).to(dtype);
  y.backward(gy);
  const auto gy64 = gy.to(torch::kDouble);
  expect_within_one_rounding(a.grad(), torch::bmm(gy64, c64.transpose(1, 2)),
                             torch::bmm(gy64.abs(), c64.abs().transpose(1, 2)), 5, "bmm da");
  expect_within_one_rounding(c.grad(), torch::bmm(a64.transpose(1, 2), gy64),
                             torch::bmm(a64.abs().transpose(1, 2), gy64.abs()), 7, "bmm db");
}

// wide_gelu_linear(x, w, b) against wide_linear(mixed_gelu(x), w, b) on the
// same numbers: 600 rows of k 4000 and n 100 run as two blocks of 256 rows
// and one of 88, so GELU runs by blocks both ways (and again in backward);
// the output and the three gradients are the same bits, with and without a
// bias.
TEST_P(WideProductsTest, GeluLinearIsWideLinearOfMixedGeluBitForBit) {
  torch::manual_seed(4);
  const auto dtype = GetParam();
  const auto x = (torch::randn({2, 300, 4000}) * 2).to(dtype);
  const auto w = (torch::randn({100, 4000}) / 64).to(dtype), b = torch::randn({100}).to(dtype);
  const auto g = torch::randn({2, 300, 100}).to(dtype);
  for (const bool with_bias : {true, false}) {
    SCOPED_TRACE(with_bias ? "with a bias" : "without a bias");
    std::vector<torch::Tensor> fused_leaves, plain_leaves;
    for (auto* leaves : {&fused_leaves, &plain_leaves}) {
      *leaves = {x.clone().requires_grad_(), w.clone().requires_grad_(),
                 with_bias ? b.clone().requires_grad_() : torch::Tensor()};
    }
    const auto fused = ampx::wide_gelu_linear(fused_leaves[0], fused_leaves[1], fused_leaves[2]);
    const auto plain =
        ampx::wide_linear(ampx::mixed_gelu(plain_leaves[0]), plain_leaves[1], plain_leaves[2]);
    ASSERT_EQ(fused.scalar_type(), dtype);
    EXPECT_TRUE(torch::equal(fused, plain));
    fused.backward(g);
    plain.backward(g);
    for (size_t i = 0; i < 3; ++i) {
      if (!plain_leaves[i].defined()) continue;
      ASSERT_TRUE(fused_leaves[i].grad().defined()) << "operand " << i;
      EXPECT_TRUE(torch::equal(fused_leaves[i].grad(), plain_leaves[i].grad())) << "operand " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, WideProductsTest,
                         ::testing::Values(torch::kBFloat16, torch::kHalf),
                         [](const auto& info) {
                           return std::string(info.param == torch::kBFloat16 ? "bf16" : "fp16");
                         });

TEST(WideProductsApiTest, RejectsOperandsThatAreNotOneSixteenBitCpuDtypeNamingThem) {
  const auto x = torch::randn({4, 8}).to(torch::kBFloat16);
  EXPECT_THAT(ampx::test::error_text([&] { ampx::wide_linear(x, torch::randn({3, 8})); }),
              ::testing::HasSubstr("bfloat16 or float16 CPU tensors, got Float"));
  EXPECT_THAT(ampx::test::error_text(
                  [&] { ampx::wide_linear(x, torch::randn({3, 8}).to(torch::kHalf)); }),
              ::testing::HasSubstr("share one dtype, got BFloat16 and Half"));
  EXPECT_THAT(ampx::test::error_text(
                  [&] { ampx::wide_linear(x, torch::randn({3, 7}).to(torch::kBFloat16)); }),
              ::testing::HasSubstr("must agree, got x [4, 8] and weight [3, 7]"));
  EXPECT_THAT(ampx::test::error_text([&] {
                ampx::wide_matmul(torch::randn({2, 4, 8}).to(torch::kBFloat16),
                                  torch::randn({3, 8, 4}).to(torch::kBFloat16));
              }),
              ::testing::HasSubstr("same batch sizes, got [2, 4, 8] and [3, 8, 4]"));
}

// Auto's rule on the rates of the machines measured so far (2 cores each):
// a Zen 3 without AVX-512 (no kernels: a scalar loop), an Intel Xeon with
// AVX512-BF16 and no AMX (oneDNN's bf16 187 GFLOP/s, MKL's float32 351; its
// AVX512-FP16 products 355), a Zen 4 with AVX512-BF16 (406 against 202).
// What wide_gelu_linear is for: backward keeps its input, not GELU's output.
// Its forward leaves its output alive and nothing else; the same layer after
// mixed_gelu leaves GELU's output too.
TEST(WideProductsApiTest, GeluLinearKeepsItsInputForBackwardNotGelusOutput) {
  ampx::enable_cpu_memory_tracking();
  const auto x = torch::randn({1024, 512}).to(torch::kBFloat16).requires_grad_();
  const auto w = torch::randn({64, 512}).div(16).to(torch::kBFloat16).requires_grad_();
  const auto b = torch::randn({64}).to(torch::kBFloat16).requires_grad_();
  const int64_t y_bytes = 1024 * 64 * 2, gelu_bytes = 1024 * 512 * 2;
  const int64_t start = ampx::cpu_memory_stats().allocated_bytes;
  const auto fused = ampx::wide_gelu_linear(x, w, b);
  const int64_t fused_bytes = ampx::cpu_memory_stats().allocated_bytes - start;
  const auto plain = ampx::wide_linear(ampx::mixed_gelu(x), w, b);
  const int64_t plain_bytes = ampx::cpu_memory_stats().allocated_bytes - start - fused_bytes;
  EXPECT_GE(fused_bytes, y_bytes);
  EXPECT_LT(fused_bytes, y_bytes + gelu_bytes / 8);
  EXPECT_GE(plain_bytes, y_bytes + gelu_bytes);
}

TEST(WideProductsApiTest, GeluLinearRejectsWhatWideLinearRejectsNamingItself) {
  const auto x = torch::randn({4, 8}).to(torch::kBFloat16), w = torch::randn({3, 8});
  EXPECT_THROW(
      {
        try {
          ampx::wide_gelu_linear(x, w);
        } catch (const c10::ValueError& e) {
          EXPECT_NE(std::string(e.what()).find("ampx::wide_gelu_linear: operands must be bfloat16 "
                                               "or float16 CPU tensors, got Float"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      c10::ValueError);
  EXPECT_THROW(ampx::wide_gelu_linear(x, w.to(torch::kBFloat16).t()), c10::ValueError);
}

TEST(WideProductsApiTest, AutoIsWideWhereSixteenBitProductsAreClearlySlowerThanFloat32) {
  EXPECT_TRUE(ampx::auto_products_are_wide(false, 0, 0));
  EXPECT_TRUE(ampx::auto_products_are_wide(false, 400, 200));  // no kernels: never timed
  EXPECT_TRUE(ampx::auto_products_are_wide(true, 187.5, 350.8));
  EXPECT_FALSE(ampx::auto_products_are_wide(true, 354.6, 350.8));
  EXPECT_FALSE(ampx::auto_products_are_wide(true, 405.6, 201.9));
  // The margin: wide only below 0.8 of the float32 rate.
  EXPECT_FALSE(ampx::auto_products_are_wide(true, 81, 100));
  EXPECT_TRUE(ampx::auto_products_are_wide(true, 79, 100));
}

// The probe times LibTorch's products where it has 16-bit kernels (both
// rates measured, the choice the rule's on them) and nothing where it has
// none; auto's choice is the probe's, measured once.
TEST(WideProductsApiTest, AutoChoosesWhatItsProbeMeasured) {
  ProductsMode mode(CpuProducts::kAuto);
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const auto& probe = ampx::cpu_products_probe(dtype);
    EXPECT_EQ(probe.native_kernels, ampx::cpu_has_native_products(dtype)) << dtype;
    if (probe.native_kernels) {
      EXPECT_GT(probe.native_gflops, 0.1) << dtype;
      EXPECT_GT(probe.float32_gflops, 0.1) << dtype;
    } else {
      EXPECT_EQ(probe.native_gflops, 0) << dtype;
      EXPECT_EQ(probe.float32_gflops, 0) << dtype;
    }
    EXPECT_EQ(probe.wide, ampx::auto_products_are_wide(probe.native_kernels,
                                                       probe.native_gflops, probe.float32_gflops))
        << dtype;
    EXPECT_EQ(ampx::cpu_products_are_wide(dtype), probe.wide) << dtype;
    EXPECT_EQ(&ampx::cpu_products_probe(dtype), &probe) << "measured once";
  }
  try {
    ampx::cpu_products_probe(torch::kFloat);
    ADD_FAILURE() << "float32 accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("dtype must be bfloat16 or float16, got Float"));
  }
  EXPECT_FALSE(ampx::cpu_products_are_wide(torch::kFloat));
  ampx::set_cpu_products(CpuProducts::kNative);
  EXPECT_FALSE(ampx::cpu_products_are_wide(torch::kBFloat16));
  ampx::set_cpu_products(CpuProducts::kWide);
  EXPECT_TRUE(ampx::cpu_products_are_wide(torch::kBFloat16));
  EXPECT_FALSE(ampx::cpu_products_are_wide(torch::kFloat));
  EXPECT_STREQ(ampx::to_string(CpuProducts::kWide), "wide");
}

// Autocast routes linear, matmul, mm, bmm and addmm through the wide
// products when they are on, LibTorch's kernels when not, and leaves ampx's
// policy registry as it found it.
TEST(WideProductsRoutingTest, AutocastMultipliesWideWhenOnAndNativelyWhenOff) {
  torch::manual_seed(4);
  const auto policies_before = ampx::get_all_cast_policies(torch::kCPU);
  const auto x = torch::randn({6, 32}), w = torch::randn({16, 32}, torch::requires_grad()),
             b = torch::randn({16}), q = torch::randn({2, 2, 6, 4}),
             a3 = torch::randn({3, 6, 32}), c3 = torch::randn({3, 32, 5});
  const auto bf = [](const torch::Tensor& t) { return t.detach().to(torch::kBFloat16); };
  {
    ProductsMode mode(CpuProducts::kWide);
    ampx::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
    const auto y = torch::nn::functional::linear(x, w, b);
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    EXPECT_THAT(grad_fn_name(y), ::testing::HasSubstr("WideLinear"));
    EXPECT_TRUE(torch::equal(y, ampx::wide_linear(bf(x), bf(w), bf(b))));
    EXPECT_TRUE(torch::equal(torch::matmul(q, q.transpose(-2, -1)),
                             ampx::wide_matmul(bf(q), bf(q).transpose(-2, -1))));
    EXPECT_TRUE(torch::equal(torch::mm(x, w.t()), ampx::wide_linear(bf(x), bf(w))));
    EXPECT_TRUE(torch::equal(torch::bmm(a3, c3), ampx::wide_bmm(bf(a3), bf(c3))));
    EXPECT_TRUE(torch::equal(torch::addmm(b, x, w.t()), ampx::wide_linear(bf(x), bf(w), bf(b))));
    // addmm with beta != 1 is not a linear layer: LibTorch's kernel.
    EXPECT_THAT(grad_fn_name(torch::addmm(b, x, w.t(), /*beta=*/2)),
                ::testing::Not(::testing::HasSubstr("Wide")));
    // The fp32 weight's gradient arrives in float32 through autocast's cast.
    y.sum().backward();
    EXPECT_EQ(w.grad().scalar_type(), torch::kFloat);
  }
  EXPECT_EQ(ampx::get_all_cast_policies(torch::kCPU), policies_before);
  {
    ProductsMode mode(CpuProducts::kNative);
    ampx::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
    const auto y = torch::nn::functional::linear(x, w, b);
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    EXPECT_THAT(grad_fn_name(y), ::testing::Not(::testing::HasSubstr("Wide")));
  }
  EXPECT_EQ(ampx::get_all_cast_policies(torch::kCPU), policies_before);
}

// LibTorch's C++ Linear on a 3-D input multiplies (matmul, routed wide) and
// then adds the bias in place: the wide product's result must allow that
// (a view made inside a custom Function would not) and train.
TEST(WideProductsRoutingTest, CppLinearOnThreeDimensionsAddsItsBiasInPlaceAndTrains) {
  ProductsMode mode(CpuProducts::kWide);
  torch::manual_seed(5);
  torch::nn::Linear linear(32, 16);
  const auto x = torch::randn({3, 6, 32});
  torch::Tensor y;
  {
    ampx::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
    y = linear(x);
  }
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  const auto bf = [](const torch::Tensor& t) { return t.detach().to(torch::kBFloat16); };
  // The product rounded to bf16, then the fp32 bias added in place (in
  // float32, rounded to the bf16 output).
  const auto product = ampx::wide_linear(bf(x), bf(linear->weight));
  EXPECT_TRUE(
      torch::equal(y, (product.to(torch::kFloat) + linear->bias.detach()).to(torch::kBFloat16)));
  y.to(torch::kFloat).sum().backward();
  EXPECT_EQ(linear->weight.grad().scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::allclose(linear->bias.grad(), torch::full({16}, 18.f)));
}

// An ampx policy on a product op is kept: mm in float32 stays float32.
TEST(WideProductsRoutingTest, AProductsOwnPolicyComesBeforeTheWideRoute) {
  ProductsMode mode(CpuProducts::kWide);
  ampx::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
  ampx::CastPolicyGuard policy(torch::kCPU, {{"aten::mm", ampx::CastPolicy::kFp32}});
  ampx::WideProductsGuard wide;  // made after the policy: it must keep it
  const auto y = torch::mm(torch::randn({4, 8}), torch::randn({8, 2}).to(torch::kBFloat16));
  EXPECT_EQ(y.scalar_type(), torch::kFloat);
}

struct TwoLayer : torch::nn::Module {
  TwoLayer() {
    fc1 = register_module("fc1", torch::nn::Linear(24, 48));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({48})));
    fc2 = register_module("fc2", torch::nn::Linear(48, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2(torch::relu(ln(fc1(x))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm ln{nullptr};
};

// O2 and O3 (a model cast to bf16, no autocast) run their linears wide in
// forward_guard(), and train: the loss falls within a few steps.
TEST(WideProductsRoutingTest, CastModelsMultiplyWideInsideTheForwardGuardAndTrain) {
  for (auto level : {ampx::OptLevel::O2, ampx::OptLevel::O3}) {
    ProductsMode mode(CpuProducts::kWide);
    torch::manual_seed(5);
    auto net = std::make_shared<TwoLayer>();
    const bool o2 = level == ampx::OptLevel::O2;
    ampx::optim::AdamW opt(
        net->parameters(),
        ampx::optim::AdamWOptions(1e-2).master_weights(o2).stochastic_rounding(!o2));
    auto amp = ampx::initialize(net, {&opt}, ampx::AmpOptions(level));
    const auto x = torch::randn({32, 24}), target = torch::randn({32, 8});
    double first = 0, last = 0;
    for (int step = 0; step < 30; ++step) {
      torch::Tensor out;
      {
        auto forward = amp.forward_guard();
        out = net->forward(amp.cast_input(x));
      }
      if (step == 0) {
        EXPECT_THAT(grad_fn_name(out), ::testing::HasSubstr("WideLinear")) << ampx::to_string(level);
        EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
      }
      auto loss = torch::mse_loss(out.to(torch::kFloat), target);
      opt.zero_grad();
      amp.scaler().scale(loss).backward();
      amp.scaler().step(opt);
      amp.scaler().update();
      (step == 0 ? first : last) = loss.item<double>();
    }
    EXPECT_LT(last, 0.7 * first) << ampx::to_string(level) << ": " << first << " -> " << last;
    // Outside the guard nothing is routed (O3: O2's fp32 norm needs the guard).
    if (!o2) {
      EXPECT_THAT(grad_fn_name(net->forward(amp.cast_input(x))),
                  ::testing::Not(::testing::HasSubstr("Wide")));
    }
  }
}

}  // namespace
