// ampx::scaled_dot_product_attention (ampx/kernels.h): the fused CPU kernel
// against a float64 reference on every instruction-set build, its bits on 1
// and 2 threads, strided inputs, the composite elsewhere, and its errors.

#include "../test_util.h"
#include "ampx/autocast.h"
#include "ampx/detail/compat.h"
#include "ampx/detail/kernels.h"
#include "ampx/kernels.h"
#include "ampx/policy.h"

#include <ATen/Parallel.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

namespace {

using ampx::test::error_text;
using ::testing::HasSubstr;

// One ulp of `dtype` at |v| (float32: 2^-23 relative).
torch::Tensor ulp_of(const torch::Tensor& v, torch::ScalarType dtype) {
  const int mantissa = dtype == torch::kBFloat16 ? 7 : dtype == torch::kHalf ? 10 : 23;
  const double min_exp = dtype == torch::kHalf ? -14 : -126;
  auto e = torch::floor(torch::log2(v.abs().clamp_min(1e-30))).clamp_min(min_exp);
  return torch::pow(2.0, e - mantissa);
}

struct Reference {
  torch::Tensor y, dq, dk, dv;
  // The largest sum of the terms' magnitudes behind each output's elements
  // (y = P V: P |V|; dq = scale dS K with dS = P (dP - D): scale P (|dP| +
  // |D|) |K|; ...): the scale float32's rounding works on where the terms
  // cancel (one key: dq and dk are exactly 0 in float64, a few ulps of the
  // terms in float32, by the order of the sums).
  double y_terms, dq_terms, dk_terms, dv_terms;
};

// softmax(q k^T * scale, mask) v and its gradients for dy, in float64 from
// the inputs' exact values.
Reference reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                    bool causal, double scale, const torch::Tensor& dy) {
  auto qd = q.detach().to(torch::kDouble).requires_grad_(true);
  auto kd = k.detach().to(torch::kDouble).requires_grad_(true);
  auto vd = v.detach().to(torch::kDouble).requires_grad_(true);
  auto s = torch::matmul(qd, kd.transpose(-2, -1)) * scale;
  if (causal) {
    const auto hidden = torch::ones({q.size(-2), k.size(-2)}, torch::kBool).triu(1);
    s = s.masked_fill(hidden, -INFINITY);
  }
  const auto probs = torch::softmax(s, -1);
  auto y = torch::matmul(probs, vd);
  const auto dyd = dy.to(torch::kDouble);
  y.backward(dyd);
  torch::NoGradGuard no_grad;
  const auto p = probs.detach();
  const auto dp = torch::matmul(dyd, vd.detach().transpose(-2, -1)).abs();
  const auto d = (dyd * y.detach()).sum(-1, /*keepdim=*/true).abs();
  const auto ds = p * (dp + d) * scale;
  const auto largest = [](const torch::Tensor& t) { return t.max().item<double>(); };
  return {y.detach(),
          qd.grad(),
          kd.grad(),
          vd.grad(),
          largest(torch::matmul(p, vd.detach().abs())),
          largest(torch::matmul(ds, kd.detach().abs())),
          largest(torch::matmul(ds.transpose(-2, -1), qd.detach().abs())),
          largest(torch::matmul(p.transpose(-2, -1), dyd.abs()))};
}

// Whether every element of `got` is within one ulp of `dtype` of `want`,
// plus float32's rounding of sums that cancel: 2^-20 of `terms`, the largest
// sum of the terms' magnitudes (Reference).
::testing::AssertionResult within_one_ulp(const char* what, const torch::Tensor& got,
                                          const torch::Tensor& want, double terms,
                                          torch::ScalarType dtype) {
  const auto err = (got.to(torch::kDouble) - want).abs();
  const auto bound = ulp_of(want, dtype) + std::ldexp(terms, -20);
  const auto ratio = (err / bound).max().item<double>();
  if (ratio <= 1.0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << " off by up to " << ratio << " of the bound";
}

struct Case {
  std::vector<int64_t> lead;
  int64_t t, s, e, ev;
  bool causal;
};

const std::vector<Case> kCases = {
    {{2, 3}, 70, 70, 40, 40, true},  // partial blocks, a width of no whole vector pair
    {{2, 3}, 70, 70, 40, 40, false},
    {{3}, 45, 77, 16, 24, false},      // L != S, Ev != E, 3-D
    {{3}, 77, 45, 16, 24, true},       // more queries than keys: late rows see every key
    {{3}, 45, 77, 16, 24, true},       // fewer queries than keys: the last keys unseen
    {{1, 2}, 1, 1, 8, 8, true},        // one query, one key
    {{2, 2}, 128, 128, 64, 64, true},  // gpt's head shape
    // Odd widths: the bf16 dot build's last pair of elements ends in padding.
    {{2}, 50, 41, 33, 17, true},
    {{2}, 9, 40, 5, 3, false},
};

torch::Tensor randn(const std::vector<int64_t>& lead, int64_t rows, int64_t width, double sd) {
  auto sizes = lead;
  sizes.push_back(rows);
  sizes.push_back(width);
  return torch::randn(sizes) * sd;
}

}  // namespace

// Every instruction-set build, float32, bfloat16 and float16, every case:
// the output and the three gradients within one ulp of float64's (scores
// with a spread of 2.5, so some rows' softmax is sharp).
TEST(AttentionTest, EveryIsaMatchesFloat64WithinOneUlpForwardAndBackward) {
  for (const auto isa : ampx::detail::cpu::supported_isas()) {
    for (const auto dtype : {torch::kBFloat16, torch::kHalf, torch::kFloat}) {
      for (size_t n = 0; n < kCases.size(); ++n) {
        const Case& c = kCases[n];
        SCOPED_TRACE(ampx::detail::cpu::isa_name(isa) + " " + c10::toString(dtype) + " case " +
                     std::to_string(n));
        torch::manual_seed(static_cast<uint64_t>(40 + n));
        const double sd = std::sqrt(2.5);
        auto q = randn(c.lead, c.t, c.e, sd).to(dtype).requires_grad_(true);
        auto k = randn(c.lead, c.s, c.e, 1.0).to(dtype).requires_grad_(true);
        auto v = randn(c.lead, c.s, c.ev, 1.0).to(dtype).requires_grad_(true);
        const auto dy = randn(c.lead, c.t, c.ev, 1.0).to(dtype);
        const double scale = 1.0 / std::sqrt(static_cast<double>(c.e));
        auto y = ampx::detail::cpu::scaled_dot_product_attention(q, k, v, c.causal, {}, isa);
        ASSERT_EQ(y.scalar_type(), dtype);
        ASSERT_EQ(y.sizes(), dy.sizes());
        y.backward(dy);
        const auto ref = reference(q, k, v, c.causal, scale, dy);
        EXPECT_TRUE(within_one_ulp("y", y.detach(), ref.y, ref.y_terms, dtype));
        EXPECT_TRUE(within_one_ulp("dq", q.grad(), ref.dq, ref.dq_terms, dtype));
        EXPECT_TRUE(within_one_ulp("dk", k.grad(), ref.dk, ref.dk_terms, dtype));
        EXPECT_TRUE(within_one_ulp("dv", v.grad(), ref.dv, ref.dv_terms, dtype));
      }
    }
  }
}

// A given scale replaces 1/sqrt(E); the public function picks the best build.
TEST(AttentionTest, TakesAScale) {
  torch::manual_seed(50);
  auto q = torch::randn({2, 33, 16}).to(torch::kBFloat16).requires_grad_(true);
  auto k = torch::randn({2, 33, 16}).to(torch::kBFloat16).requires_grad_(true);
  auto v = torch::randn({2, 33, 16}).to(torch::kBFloat16).requires_grad_(true);
  const auto dy = torch::randn({2, 33, 16}).to(torch::kBFloat16);
  auto y = ampx::scaled_dot_product_attention(q, k, v, /*is_causal=*/true, 0.7);
  y.backward(dy);
  const auto ref = reference(q, k, v, true, 0.7, dy);
  EXPECT_TRUE(within_one_ulp("y", y.detach(), ref.y, ref.y_terms, torch::kBFloat16));
  EXPECT_TRUE(within_one_ulp("dq", q.grad(), ref.dq, ref.dq_terms, torch::kBFloat16));
}

// Heads split across 1 or 2 threads: the same bits forward and backward, in
// every build (the bf16 dot-product one included, where the CPU has it).
TEST(AttentionTest, SameBitsOnOneAndTwoThreads) {
  const int threads = at::get_num_threads();
  torch::manual_seed(51);
  const auto q0 = torch::randn({4, 3, 100, 32}).to(torch::kBFloat16);
  const auto k0 = torch::randn({4, 3, 100, 32}).to(torch::kBFloat16);
  const auto v0 = torch::randn({4, 3, 100, 32}).to(torch::kBFloat16);
  const auto dy = torch::randn({4, 3, 100, 32}).to(torch::kBFloat16);
  for (const auto isa : ampx::detail::cpu::supported_isas()) {
    SCOPED_TRACE(ampx::detail::cpu::isa_name(isa));
    std::vector<torch::Tensor> runs[2];
    for (int n : {1, 2}) {
      at::set_num_threads(n);
      ASSERT_EQ(at::get_num_threads(), n);
      auto q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true),
           v = v0.clone().requires_grad_(true);
      auto y = ampx::detail::cpu::scaled_dot_product_attention(q, k, v, true, {}, isa);
      y.backward(dy);
      runs[n - 1] = {y.detach(), q.grad(), k.grad(), v.grad()};
    }
    for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(torch::equal(runs[0][i], runs[1][i])) << i;
  }
  at::set_num_threads(threads);
}

// The AVX512_BF16 build multiplies bf16 Q K^T and dO V^T with vdpbf16ps
// (other sums, other bits: within the float64 test's bound) and runs every
// other dtype as the AVX512 build does, bit for bit. The public function
// runs it wherever the CPU has it, unless ATEN_CPU_CAPABILITY asks lower
// (ctest's kernels.isa_avx512 reruns these tests on the plain build).
TEST(AttentionTest, Bf16DotBuildKeepsFloat16AndFloat32OnTheWideKernel) {
  using ampx::detail::cpu::Isa;
  const auto isas = ampx::detail::cpu::supported_isas();
  if (isas.back() != Isa::kAvx512Bf16) {
    std::cout << "no AVX512-BF16 on this CPU: the bf16 dot build is not run\n";
    return;
  }
  torch::manual_seed(56);
  const auto q0 = torch::randn({2, 3, 70, 40}), k0 = torch::randn({2, 3, 70, 40}),
             v0 = torch::randn({2, 3, 70, 24}), dy0 = torch::randn({2, 3, 70, 24});
  const auto run = [&](torch::ScalarType dtype, Isa isa) {
    // (clones: q0.to(kFloat) is q0 itself)
    auto q = q0.to(dtype).clone().requires_grad_(true),
         k = k0.to(dtype).clone().requires_grad_(true),
         v = v0.to(dtype).clone().requires_grad_(true);
    auto y = ampx::detail::cpu::scaled_dot_product_attention(q, k, v, true, {}, isa);
    y.backward(dy0.to(dtype));
    return std::vector<torch::Tensor>{y.detach(), q.grad(), k.grad(), v.grad()};
  };
  for (const auto dtype : {torch::kHalf, torch::kFloat}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto wide = run(dtype, Isa::kAvx512), dot_build = run(dtype, Isa::kAvx512Bf16);
    for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(torch::equal(wide[i], dot_build[i])) << i;
  }
  // bf16: the products' sums differ in order, so some bits do.
  const auto wide = run(torch::kBFloat16, Isa::kAvx512),
             dot = run(torch::kBFloat16, Isa::kAvx512Bf16);
  EXPECT_FALSE(torch::equal(wide[1], dot[1]));
  // ATen's capabilities name ampx's builds below this one (ctest's
  // kernels.isa_* tests, or a user's ATEN_CPU_CAPABILITY=avx2).
  const char* asked = std::getenv("ATEN_CPU_CAPABILITY");
  const std::string capability = asked != nullptr ? asked : "";
  const std::string want =
      capability == "default" || capability == "avx2" || capability == "avx512" ? capability
                                                                                  : "avx512_bf16";
  EXPECT_EQ(ampx::detail::cpu::isa_name(ampx::detail::cpu::best_isa()), want);
}

// q, k, v as a model makes them (views of one [B, T, 3, H, E] projection, so
// rows are 3 H E apart): the same bits as contiguous copies, and an output
// whose heads merge without a copy.
TEST(AttentionTest, StridedInputsGiveTheBitsOfContiguousOnesAndHeadsMergeWithoutACopy) {
  torch::manual_seed(52);
  const int64_t B = 2, T = 40, H = 3, E = 16;
  const auto qkv = torch::randn({B, T, 3, H, E}).to(torch::kBFloat16);
  const auto parts = qkv.permute({2, 0, 3, 1, 4}).unbind(0);  // 3 x [B, H, T, E]
  ASSERT_FALSE(parts[0].is_contiguous());
  const auto y = ampx::scaled_dot_product_attention(parts[0], parts[1], parts[2], true);
  const auto y_copy = ampx::scaled_dot_product_attention(
      parts[0].contiguous(), parts[1].contiguous(), parts[2].contiguous(), true);
  EXPECT_TRUE(torch::equal(y, y_copy));
  EXPECT_TRUE(y.transpose(1, 2).is_contiguous());
  // Backward too: the gradient of the projection from the strided views,
  // against the gradients of contiguous copies.
  const auto leaf = qkv.clone().requires_grad_(true);
  const auto views = leaf.permute({2, 0, 3, 1, 4}).unbind(0);
  const auto dy = torch::randn({B, H, T, E}).to(torch::kBFloat16);
  ampx::scaled_dot_product_attention(views[0], views[1], views[2], true).backward(dy);
  std::vector<torch::Tensor> copies;
  for (const auto& p : parts) copies.push_back(p.contiguous().requires_grad_(true));
  ampx::scaled_dot_product_attention(copies[0], copies[1], copies[2], true).backward(dy);
  const auto grads = leaf.grad().permute({2, 0, 3, 1, 4}).unbind(0);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(grads[i], copies[i].grad())) << i;
}

// The result is a tensor of its own, as ATen's is: it can be modified in
// place (a view made inside the custom Function could not: the op itself
// threw), after which backward reports autograd's own version error, since
// the output is saved, as ATen's flash attention saves it; and a second
// derivative is refused by name rather than silently missing this op.
TEST(AttentionTest, OutputTakesInPlaceOpsAndSecondDerivativesAreRefused) {
  torch::manual_seed(55);
  auto q = torch::randn({2, 2, 10, 8}).to(torch::kBFloat16).requires_grad_(true);
  const auto k = torch::randn({2, 2, 10, 8}).to(torch::kBFloat16);
  const auto v = torch::randn({2, 2, 10, 8}).to(torch::kBFloat16);
  auto y = ampx::scaled_dot_product_attention(q, k, v, true);
  EXPECT_EQ(
      error_text([&] {
        y.add_(1);
        y.transpose(1, 2).reshape({2, 10, 16}).mul_(2);  // a view of it, as a head merge makes
      }),
      "");
  EXPECT_THAT(error_text([&] { y.sum().backward(); }),
              HasSubstr("modified by an inplace operation"));
  auto y2 = ampx::scaled_dot_product_attention(q, k, v, true);
  EXPECT_THAT(error_text([&] {
                torch::autograd::grad({y2.to(torch::kFloat).pow(2).sum()}, {q}, {},
                                      /*retain_graph=*/true, /*create_graph=*/true);
              }),
              HasSubstr("not twice differentiable"));
}

// Other dtypes run the composite: float64 matches the reference closely.
TEST(AttentionTest, Float64RunsTheComposite) {
  torch::manual_seed(53);
  auto q = torch::randn({2, 20, 8}, torch::kDouble).requires_grad_(true);
  auto k = torch::randn({2, 20, 8}, torch::kDouble).requires_grad_(true);
  auto v = torch::randn({2, 20, 8}, torch::kDouble).requires_grad_(true);
  EXPECT_FALSE(ampx::scaled_dot_product_attention_is_fused(q, k, v));
  auto y = ampx::scaled_dot_product_attention(q, k, v, true);
  const auto dy = torch::randn({2, 20, 8}, torch::kDouble);
  y.backward(dy);
  const auto ref = reference(q, k, v, true, 1.0 / std::sqrt(8.0), dy);
  EXPECT_TRUE(torch::allclose(y, ref.y, 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(q.grad(), ref.dq, 1e-12, 1e-12));
}

TEST(AttentionTest, ErrorsNameTheArgument) {
  const auto q = torch::randn({2, 5, 8});
  EXPECT_THAT(error_text([&] { ampx::scaled_dot_product_attention(q, q.to(torch::kBFloat16), q); }),
              HasSubstr("one dtype; got query Float, key BFloat16"));
  EXPECT_THAT(error_text([&] {
                ampx::scaled_dot_product_attention(q, torch::randn({2, 5, 4}), q);
              }),
              HasSubstr("key's last size (4) must equal query's (8)"));
  EXPECT_THAT(error_text([&] {
                ampx::scaled_dot_product_attention(q, q, torch::randn({2, 6, 8}));
              }),
              HasSubstr("value's length (6"));
  EXPECT_THAT(error_text([&] {
                ampx::scaled_dot_product_attention(q, torch::randn({3, 5, 8}), q);
              }),
              HasSubstr("same leading (batch, head) sizes"));
  EXPECT_THAT(error_text([&] { ampx::scaled_dot_product_attention(torch::randn({8}), q, q); }),
              HasSubstr("at least 2"));
}

// On LibTorch 2.1+, ampx's mixed-precision regions on the CPU run 16-bit
// at::scaled_dot_product_attention without a mask or dropout through ampx's
// kernel: autocast (O1: the inputs cast to bf16 first) and the guard of O2's
// forward; a mask keeps ATen's, and so does code outside a region.
TEST(AttentionTest, MixedRegionsRouteAtensAttentionToTheFusedKernel) {
#if !AMPX_TORCH_AT_LEAST(2, 1)
  GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no at::scaled_dot_product_attention";
#else
  torch::manual_seed(54);
  const auto q = torch::randn({2, 3, 20, 16}, torch::requires_grad());
  const auto k = torch::randn({2, 3, 20, 16}), v = torch::randn({2, 3, 20, 16});
  const auto bf = [](const torch::Tensor& t) { return t.detach().to(torch::kBFloat16); };
  const auto fused = ampx::scaled_dot_product_attention(bf(q), bf(k), bf(v), true);
  torch::Tensor o1, masked;
  {
    ampx::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
    o1 = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
    const auto mask = torch::ones({20, 20}, torch::kBool).tril();
    masked = at::scaled_dot_product_attention(q, k, v, mask);
  }
  EXPECT_EQ(o1.scalar_type(), torch::kBFloat16);
  EXPECT_THAT(o1.grad_fn()->name(), HasSubstr("FusedAttention"));
  EXPECT_TRUE(torch::equal(o1, fused));
  EXPECT_THAT(masked.grad_fn()->name(), ::testing::Not(HasSubstr("FusedAttention")));
  o1.to(torch::kFloat).sum().backward();
  ASSERT_TRUE(q.grad().defined());
  EXPECT_EQ(q.grad().scalar_type(), torch::kFloat);
  {
    ampx::WideProductsGuard o2;  // what AmpSession::forward_guard() makes for O2 on the CPU
    const auto y = at::scaled_dot_product_attention(bf(q).requires_grad_(true), bf(k), bf(v), {},
                                                    0.0, /*is_causal=*/true);
    EXPECT_THAT(y.grad_fn()->name(), HasSubstr("FusedAttention"));
    EXPECT_TRUE(torch::equal(y, fused));
  }
  {
    // A scale, no causal mask and L != S reach the kernel as given: ATen's
    // float32 result from the same bf16 inputs, within a bf16 rounding.
    const auto q12 = torch::randn({2, 3, 12, 16}), k20 = torch::randn({2, 3, 20, 16}),
               v20 = torch::randn({2, 3, 20, 8});
    torch::Tensor y;
    {
      ampx::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      y = at::scaled_dot_product_attention(q12.requires_grad_(true), k20, v20, {}, 0.0,
                                           /*is_causal=*/false, /*scale=*/0.3);
    }
    EXPECT_THAT(y.grad_fn()->name(), HasSubstr("FusedAttention"));
    const auto aten =
        at::scaled_dot_product_attention(bf(q12).to(torch::kFloat), bf(k20).to(torch::kFloat),
                                         bf(v20).to(torch::kFloat), {}, 0.0, false, 0.3);
    EXPECT_TRUE(torch::allclose(y.to(torch::kFloat), aten, 1e-2, 1e-2));
  }
  const auto outside = at::scaled_dot_product_attention(bf(q).requires_grad_(true), bf(k), bf(v),
                                                        {}, 0.0, /*is_causal=*/true);
  EXPECT_THAT(outside.grad_fn()->name(), ::testing::Not(HasSubstr("FusedAttention")));
#endif
}
