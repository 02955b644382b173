// Cast policies: per-op overrides of autocast's lists on the Autocast keys,
// guards and presets (KeepNormsFp32Guard and Fp32RegionGuard:
// policy_norms_test.cpp). Expectations are what each LibTorch version does,
// checked on real ops.

#include "ampx/kernels.h"
#include "ampx/policy.h"

#include "../test_util.h"
#include "ampx/autocast.h"
#include "policy_fixture.h"

#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace policy_test {

// A custom op with a CPU kernel and no autocast kernel (policy_fixture.h);
// registered here, once for the binary.
TORCH_LIBRARY(ampx_test, m) {
  m.def("scale_add(Tensor a, Tensor b) -> Tensor");
}
TORCH_LIBRARY_IMPL(ampx_test, CPU, m) {
  m.impl("scale_add", &scale_add_cpu);
}

namespace {

using ampx::AutocastGuard;
using ampx::CastPolicy;
using ampx::CastPolicyGuard;

TEST_F(PolicyTest, GuardOverridesMmAndSoftmaxAndRestores) {
  auto a = rnd({8, 8}), b = rnd({8, 8});
  AutocastGuard autocast(torch::kCPU);
  // PyTorch's CPU lists on both versions: mm in bf16, softmax not cast.
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
  EXPECT_EQ(torch::softmax(a, 1).scalar_type(), torch::kFloat);
  {
    CastPolicyGuard policy(torch::kCPU, {{"aten::mm", CastPolicy::kFp32},
                                         {"aten::softmax", CastPolicy::kLowerPrecision}});
    EXPECT_EQ(torch::mm(a.to(torch::kBFloat16), b).scalar_type(), torch::kFloat);
    EXPECT_EQ(torch::softmax(a, 1).scalar_type(), torch::kBFloat16);
    EXPECT_EQ(ampx::get_cast_policy(torch::kCPU, "aten::mm"), CastPolicy::kFp32);
    EXPECT_EQ(ampx::get_cast_policy(torch::kCPU, "aten::softmax.int"), CastPolicy::kLowerPrecision);
    // Values: kFp32 runs mm on fp32 copies of its inputs, so a bf16 input
    // enters as its exact fp32 value and the fp32 input is not rounded.
    auto ab = a.to(torch::kBFloat16);
    const auto y = torch::mm(ab, b);
    AutocastGuard off(torch::kCPU, c10::nullopt, /*enabled=*/false);
    const auto fp32_product = torch::mm(ab.to(torch::kFloat), b);
    const auto bf16_product = torch::mm(ab, b.to(torch::kBFloat16)).to(torch::kFloat);
    EXPECT_TRUE(torch::allclose(y, fp32_product, /*rtol=*/1e-6, /*atol=*/1e-6))
        << (y - fp32_product).abs().max();
    // The check has teeth: rounding b (or the product) to bf16 is far off.
    EXPECT_GT((bf16_product - fp32_product).abs().max().item<float>(), 1e-3);
    EXPECT_FALSE(torch::allclose(y, bf16_product, /*rtol=*/1e-6, /*atol=*/1e-6));
  }
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
  EXPECT_EQ(torch::softmax(a, 1).scalar_type(), torch::kFloat);
  EXPECT_FALSE(ampx::get_cast_policy(torch::kCPU, "aten::mm").has_value());
}

// Each replacement drops the kernel it replaces: after a reset, PyTorch's
// own kernel acts again, not a policy set (and replaced) before.
TEST_F(PolicyTest, ReplacingAPolicyLeavesNoKernelBehind) {
  const auto a = rnd({4, 4});
  ampx::set_cast_policy(torch::kCPU, "aten::mm", CastPolicy::kFp32);
  ampx::set_cast_policy(torch::kCPU, "aten::mm", CastPolicy::kPassthrough);
  {
    CastPolicyGuard nested(torch::kCPU, {{"aten::mm", CastPolicy::kPromote}});
  }
  ampx::reset_cast_policy(torch::kCPU, "aten::mm");
  const auto products = ampx::get_cpu_products();
  ampx::set_cpu_products(ampx::CpuProducts::kNative);  // no routing of products
  {
    AutocastGuard autocast(torch::kCPU);
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
  }
  ampx::set_cpu_products(products);  // the process's (make test pins each path)
}

TEST_F(PolicyTest, PoliciesActOnlyInsideAutocast) {
  CastPolicyGuard policy(torch::kCPU, {{"aten::mm", CastPolicy::kLowerPrecision}});
  EXPECT_EQ(torch::mm(rnd({4, 4}), rnd({4, 4})).scalar_type(), torch::kFloat);
}

TEST_F(PolicyTest, SetAndResetAreProcessWide) {
  auto a = rnd({4, 4});
  ampx::set_cast_policy(torch::kCPU, "aten::mm", CastPolicy::kFp32);
  EXPECT_EQ(ampx::get_cast_policy(torch::kCPU, "aten::mm"), CastPolicy::kFp32);
  EXPECT_FALSE(ampx::get_cast_policy(torch::kCUDA, "aten::mm").has_value());
  {
    AutocastGuard autocast(torch::kCPU);
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kFloat);
  }
  // Another thread's autocast region sees it too.
  torch::ScalarType in_thread = torch::kDouble;
  std::thread([&] {
    AutocastGuard autocast(torch::kCPU);
    in_thread = torch::mm(a, a).scalar_type();
  }).join();
  EXPECT_EQ(in_thread, torch::kFloat);
  ampx::reset_cast_policy(torch::kCPU, "aten::mm");
  EXPECT_FALSE(ampx::get_cast_policy(torch::kCPU, "aten::mm").has_value());
  AutocastGuard autocast(torch::kCPU);
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);

  ampx::set_cast_policy(torch::kCPU, "aten::mm", CastPolicy::kFp32);
  ampx::set_cast_policy(torch::kCPU, "aten::bmm", CastPolicy::kFp32);
  // One entry per overload the two names cover (2.11 adds mm.dtype, for one).
  EXPECT_EQ(ampx::get_all_cast_policies(torch::kCPU).size(),
            ampx::cast_policy_overloads("aten::mm").size() +
                ampx::cast_policy_overloads("aten::bmm").size());
  ampx::reset_all_cast_policies(torch::kCPU);
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
}

TEST_F(PolicyTest, NestedGuardsRestoreInOrder) {
  auto a = rnd({4, 4});
  AutocastGuard autocast(torch::kCPU);
  {
    CastPolicyGuard outer(torch::kCPU, {{"aten::mm", CastPolicy::kFp32}});
    {
      CastPolicyGuard inner(torch::kCPU, {{"aten::mm", CastPolicy::kLowerPrecision},
                                          {"aten::exp", CastPolicy::kLowerPrecision}});
      EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
      EXPECT_EQ(torch::exp(a).scalar_type(), torch::kBFloat16);
    }
    EXPECT_EQ(ampx::get_cast_policy(torch::kCPU, "aten::mm"), CastPolicy::kFp32);
    EXPECT_FALSE(ampx::get_cast_policy(torch::kCPU, "aten::exp").has_value());
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kFloat);
    EXPECT_EQ(torch::exp(a).scalar_type(), torch::kFloat);
  }
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
}

TEST_F(PolicyTest, GuardRestoresOnException) {
  try {
    CastPolicyGuard policy(torch::kCPU, {{"aten::mm", CastPolicy::kFp32}});
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(ampx::get_cast_policy(torch::kCPU, "aten::mm").has_value());
  // A bad name anywhere in the list sets nothing.
  EXPECT_THROW(CastPolicyGuard(torch::kCPU, {{"aten::mm", CastPolicy::kFp32},
                                             {"aten::no_such_op", CastPolicy::kFp32}}),
               c10::Error);
  EXPECT_FALSE(ampx::get_cast_policy(torch::kCPU, "aten::mm").has_value());
}

TEST_F(PolicyTest, PromoteCastsToWidestInput) {
  auto a = rnd({4, 4}), b = rnd({4, 4}, torch::kBFloat16);
  AutocastGuard autocast(torch::kCPU);
  EXPECT_EQ(torch::mm(b, a).scalar_type(), torch::kBFloat16);  // PyTorch: lower precision
  CastPolicyGuard policy(torch::kCPU, {{"aten::mm", CastPolicy::kPromote}});
  EXPECT_EQ(torch::mm(b, a).scalar_type(), torch::kFloat);
  EXPECT_EQ(torch::mm(b, b).scalar_type(), torch::kBFloat16);
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kFloat);
}

TEST_F(PolicyTest, PassthroughTurnsAutocastOffForTheOp) {
  auto x = rnd({4, 8}), w = rnd({3, 8});
  AutocastGuard autocast(torch::kCPU);
  EXPECT_EQ(torch::mm(x, w.t()).scalar_type(), torch::kBFloat16);
  CastPolicyGuard policy(torch::kCPU, {{"aten::mm", CastPolicy::kPassthrough},
                                       {"aten::linear", CastPolicy::kPassthrough}});
  EXPECT_EQ(torch::mm(x, w.t()).scalar_type(), torch::kFloat);
  // linear's decomposition (matmul/addmm) runs without autocast too.
  EXPECT_EQ(torch::linear(x, w).scalar_type(), torch::kFloat);
  EXPECT_EQ(torch::matmul(x, w.t()).scalar_type(), torch::kBFloat16);  // not named: PyTorch's
}

TEST_F(PolicyTest, CustomOpFollowsItsPolicy) {
  auto a = rnd({4}), b = rnd({4});
  AutocastGuard autocast(torch::kCPU);
  EXPECT_EQ(scale_add(a, b).scalar_type(), torch::kFloat);  // no policy: untouched
  EXPECT_EQ(g_seen_a, torch::kFloat);
  {
    CastPolicyGuard policy(torch::kCPU, {{"ampx_test::scale_add", CastPolicy::kLowerPrecision}});
    auto y = scale_add(a, b);
    EXPECT_EQ(g_seen_a, torch::kBFloat16);
    EXPECT_EQ(g_seen_b, torch::kBFloat16);
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  }
  {
    CastPolicyGuard policy(torch::kCPU, {{"ampx_test::scale_add", CastPolicy::kFp32}});
    auto y = scale_add(a.to(torch::kBFloat16), b);
    EXPECT_EQ(g_seen_a, torch::kFloat);
    EXPECT_EQ(y.scalar_type(), torch::kFloat);
  }
  {
    CastPolicyGuard policy(torch::kCPU,
                           {{"ampx_test::scale_add", CastPolicy::kFp32OutputsAsInput}});
    auto y = scale_add(a.to(torch::kBFloat16), b);
    EXPECT_EQ(g_seen_a, torch::kFloat);            // computed in fp32
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);  // returned as the first input was
  }
  EXPECT_EQ(scale_add(a, b).scalar_type(), torch::kFloat);
  EXPECT_EQ(g_seen_a, torch::kFloat);
}

TEST_F(PolicyTest, GradientsFlowThroughCasts) {
  auto a = rnd({4, 4}, torch::kBFloat16).requires_grad_();
  auto w = rnd({4, 4}).requires_grad_();
  AutocastGuard autocast(torch::kCPU);
  CastPolicyGuard policy(torch::kCPU, {{"aten::mm", CastPolicy::kFp32}});
  auto y = torch::mm(a, w);
  EXPECT_EQ(y.scalar_type(), torch::kFloat);
  y.sum().backward();
  ASSERT_TRUE(a.grad().defined());
  EXPECT_EQ(a.grad().scalar_type(), torch::kBFloat16);
  EXPECT_EQ(w.grad().scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::allclose(w.grad(), a.to(torch::kFloat).sum(0).unsqueeze(1).expand({4, 4})));
}

TEST_F(PolicyTest, NameCoversFunctionalOverloads) {
  auto softmax = ampx::cast_policy_overloads("aten::softmax");
  EXPECT_NE(std::find(softmax.begin(), softmax.end(), "aten::softmax.int"), softmax.end());
  for (const auto& name : softmax) EXPECT_EQ(name.find(".out"), std::string::npos) << name;
  // "aten::mm" covers the functional overloads (2.11 adds aten::mm.dtype), never mm.out.
  const auto mm = ampx::cast_policy_overloads("aten::mm");
  EXPECT_NE(std::find(mm.begin(), mm.end(), "aten::mm"), mm.end());
  for (const auto& name : mm) {
    EXPECT_EQ(name.rfind("aten::mm", 0), 0u) << name;
    EXPECT_NE(name, "aten::mm.out");
  }
  EXPECT_EQ(ampx::cast_policy_overloads("aten::mm.out"), std::vector<std::string>{"aten::mm.out"});
  // Set per overload, read per name: the shared policy or nothing. (aten::sum
  // has two functional overloads on every LibTorch, sum and sum.dim_IntList;
  // softmax's second, softmax.Dimname, is gone since 2.13 with named tensors.)
  const auto sum = ampx::cast_policy_overloads("aten::sum");
  ASSERT_NE(std::find(sum.begin(), sum.end(), "aten::sum.dim_IntList"), sum.end());
  ASSERT_NE(std::find(sum.begin(), sum.end(), "aten::sum"), sum.end());
  CastPolicyGuard policy(torch::kCPU, {{"aten::sum.dim_IntList", CastPolicy::kFp32}});
  EXPECT_EQ(ampx::get_cast_policy(torch::kCPU, "aten::sum.dim_IntList"), CastPolicy::kFp32);
  EXPECT_FALSE(ampx::get_cast_policy(torch::kCPU, "aten::sum").has_value());
  CastPolicyGuard both(torch::kCPU, {{"aten::sum", CastPolicy::kFp32}});
  EXPECT_EQ(ampx::get_cast_policy(torch::kCPU, "aten::sum"), CastPolicy::kFp32);
}

TEST_F(PolicyTest, ErrorsNameTheProblem) {
  EXPECT_EQ(ampx::test::error_text(
                [] { ampx::set_cast_policy(torch::kCPU, "aten::no_such_op", CastPolicy::kFp32); }),
            "set_cast_policy: no operator \"aten::no_such_op\" is registered (custom ops must be "
            "defined before their policy is set)");
  EXPECT_EQ(
      ampx::test::error_text([] { ampx::set_cast_policy(torch::kCPU, "mm", CastPolicy::kFp32); }),
      "set_cast_policy: op must be a schema name with namespace, such as \"aten::mm\" or "
      "\"aten::softmax.int\", got \"mm\"");
  EXPECT_EQ(ampx::test::error_text(
                [] { ampx::set_cast_policy(torch::kMeta, "aten::mm", CastPolicy::kFp32); }),
            "set_cast_policy: device_type must be cpu or cuda, got meta");
}

TEST_F(PolicyTest, CudaPolicyLeavesCpuAlone) {
  auto a = rnd({4, 4});
  CastPolicyGuard policy(torch::kCUDA, {{"aten::mm", CastPolicy::kFp32}});
  AutocastGuard autocast(torch::kCPU);
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
}

TEST_F(PolicyTest, CudaGuardOverridesMm) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "CUDA not available";
  auto a = rnd({8, 8}).cuda();
  AutocastGuard autocast(torch::kCUDA);
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kHalf);
  EXPECT_EQ(torch::softmax(a.to(torch::kHalf), 1).scalar_type(), torch::kFloat);
  {
    CastPolicyGuard policy(torch::kCUDA, {{"aten::mm", CastPolicy::kFp32},
                                          {"aten::softmax", CastPolicy::kLowerPrecision}});
    EXPECT_EQ(torch::mm(a.to(torch::kHalf), a).scalar_type(), torch::kFloat);
    EXPECT_EQ(torch::softmax(a, 1).scalar_type(), torch::kHalf);
  }
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kHalf);
}

TEST_F(PolicyTest, ApexO1PresetChangesWhereListsDiffer) {
  auto a = rnd({4, 4}), v = rnd({4});
  auto low = a.to(torch::kBFloat16);
  AutocastGuard autocast(torch::kCPU);
  // PyTorch's CPU lists (1.13 and 2.6): softmax, exp, sum not cast; mv not cast.
  EXPECT_EQ(torch::softmax(low, 1).scalar_type(), torch::kBFloat16);
  EXPECT_EQ(torch::exp(low).scalar_type(), torch::kBFloat16);
  EXPECT_EQ(torch::mv(a, v).scalar_type(), torch::kFloat);
  {
    ampx::CastPolicyPresetGuard o1(torch::kCPU, ampx::CastPolicyPreset::kApexO1);
    EXPECT_EQ(torch::softmax(low, 1).scalar_type(), torch::kFloat);  // Apex FP32_FUNCS
    EXPECT_EQ(torch::exp(low).scalar_type(), torch::kFloat);
    EXPECT_EQ(low.sum().scalar_type(), torch::kFloat);
    EXPECT_EQ(torch::mv(a, v).scalar_type(), torch::kBFloat16);    // Apex FP16_FUNCS
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);    // both agree
    EXPECT_EQ(torch::cat({low, a}).scalar_type(), torch::kFloat);  // SEQUENCE_CASTS
    {
      ampx::CastPolicyPresetGuard pytorch(torch::kCPU, ampx::CastPolicyPreset::kPyTorch);
      EXPECT_EQ(torch::softmax(low, 1).scalar_type(), torch::kBFloat16);
    }
    EXPECT_EQ(torch::softmax(low, 1).scalar_type(), torch::kFloat);
  }
  EXPECT_EQ(torch::softmax(low, 1).scalar_type(), torch::kBFloat16);
  ampx::apply_cast_policy_preset(torch::kCPU, ampx::CastPolicyPreset::kApexO1);
  EXPECT_EQ(ampx::get_cast_policy(torch::kCPU, "aten::mv"), CastPolicy::kLowerPrecision);
  ampx::apply_cast_policy_preset(torch::kCPU, ampx::CastPolicyPreset::kPyTorch);
  EXPECT_TRUE(ampx::get_all_cast_policies(torch::kCPU).empty());
}

}  // namespace
}  // namespace policy_test
