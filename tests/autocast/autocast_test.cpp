// AutocastGuard against Python's torch.autocast: op dtypes from PyTorch itself
// (tests/reference/torch_reference.py on the same LibTorch version), nesting,
// cache, restoration from exceptions and threads, and custom_fwd
// (autocast_restore_test.cpp: what a guard saves comes back).

#include "ampx/autocast.h"

#include "../test_util.h"
#include "autocast_fixture.h"
#include "ampx/detail/compat.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <stdexcept>
#include <thread>

namespace {

using ::testing::HasSubstr;

using ampx::AutocastGuard;
using ampx::test::cpu_half_supported;
namespace F = torch::nn::functional;

std::string dtype_name(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kHalf: return "float16";
    case torch::kDouble: return "float64";
    default: return c10::toString(t.scalar_type());
  }
}

// The same ops, inputs and names as autocast_ops() in torch_reference.py.
std::map<std::string, std::function<torch::Tensor()>> autocast_ops() {
  auto g = at::detail::createCPUGenerator(0);
  auto r = [&](std::vector<int64_t> shape) { return at::randn(shape, g); };
  auto a = r({8, 8}), b = r({8, 8});
  auto a3 = r({2, 8, 8}), b3 = r({2, 8, 8});
  auto img = r({1, 3, 8, 8}), w2d = r({4, 3, 3, 3});
  auto sig = r({1, 3, 16}), w1d = r({4, 3, 3});
  auto wt2d = r({3, 4, 3, 3});
  auto logits = r({4, 5});
  auto target = torch::tensor({0, 1, 2, 3});
  auto prob = torch::sigmoid(r({4, 5}));
  auto low = a.to(torch::kBFloat16);
  return {
      {"mm", [=] { return torch::mm(a, b); }},
      {"matmul", [=] { return torch::matmul(a, b); }},
      {"linear", [=] { return F::linear(a, b); }},
      {"bmm", [=] { return torch::bmm(a3, b3); }},
      {"addmm", [=] { return torch::addmm(a, a, b); }},
      {"baddbmm", [=] { return torch::baddbmm(a3, a3, b3); }},
      {"conv1d", [=] { return F::conv1d(sig, w1d); }},
      {"conv2d", [=] { return F::conv2d(img, w2d); }},
      {"conv_transpose2d", [=] { return F::conv_transpose2d(img, wt2d); }},
      {"relu", [=] { return torch::relu(a); }},
      {"exp", [=] { return torch::exp(a); }},
      {"log_softmax", [=] { return torch::log_softmax(a, 1); }},
      {"softmax", [=] { return torch::softmax(a, 1); }},
      {"layer_norm", [=] { return F::layer_norm(a, F::LayerNormFuncOptions({8})); }},
      {"group_norm", [=] { return F::group_norm(img, F::GroupNormFuncOptions(3)); }},
      {"batch_norm",
       [=] {
         return torch::batch_norm(img, {}, {}, {}, {}, /*training=*/true, 0.1, 1e-5, false);
       }},
      {"mse_loss", [=] { return F::mse_loss(a, b); }},
      {"l1_loss", [=] { return F::l1_loss(a, b); }},
      {"cross_entropy", [=] { return F::cross_entropy(logits, target); }},
      {"nll_loss", [=] { return F::nll_loss(logits, target); }},
      {"binary_cross_entropy", [=] { return F::binary_cross_entropy(prob, prob); }},
      {"cdist", [=] { return torch::cdist(a, b); }},
      {"prod", [=] { return torch::prod(a); }},
      {"sum", [=] { return torch::sum(a); }},
      {"cat_mixed", [=] { return torch::cat({a, low}); }},
      {"stack_mixed", [=] { return torch::stack({a, low}); }},
      {"mm_of_low", [=] { return torch::mm(low, low); }},
      {"softmax_of_low", [=] { return torch::softmax(low, 1); }},
      {"mse_loss_of_low", [=] { return F::mse_loss(low, low); }},
      {"layer_norm_of_low", [=] { return F::layer_norm(low, F::LayerNormFuncOptions({8})); }},
  };
}

void expect_dtypes_match_pytorch(torch::ScalarType dtype, const std::string& key) {
  const auto ref = ampx::test::load_reference("autocast_dtypes.json");
  ASSERT_TRUE(ref.contains("dtypes") && ref["dtypes"].contains(key))
      << "PyTorch " << ref.value("torch_version", "?") << " gave no " << key << " reference";
  const auto& expected = ref["dtypes"][key];
  const auto ops = autocast_ops();
  ASSERT_EQ(ops.size(), expected.size()) << "op lists of the test and the script differ";
  for (const auto& op : ops) {
    ASSERT_TRUE(expected.contains(op.first)) << op.first << " missing from the reference";
    torch::Tensor y;
    {
      AutocastGuard guard(torch::kCPU, dtype);
      y = op.second();
    }
    EXPECT_EQ(dtype_name(y), expected[op.first].get<std::string>())
        << op.first << " under CPU autocast(" << key << ") vs PyTorch "
        << ref["torch_version"].get<std::string>();
  }
}

TEST(AutocastTest, CpuBf16OpDtypesMatchPyTorch) {
  expect_dtypes_match_pytorch(torch::kBFloat16, "bfloat16");
}

TEST(AutocastTest, CpuFp16OpDtypesMatchPyTorchOn2x) {
  if (!cpu_half_supported()) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no float16 CPU autocast";
  }
  expect_dtypes_match_pytorch(torch::kHalf, "float16");
}

// Independently of the reference: the core of the policy on every version.
TEST(AutocastTest, MatmulRunsLowAndLossesStayFp32) {
  auto a = torch::randn({4, 4}), b = torch::randn({4, 4});
  AutocastGuard guard(torch::kCPU);
  EXPECT_EQ(guard.dtype(), torch::kBFloat16);
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
  EXPECT_EQ(F::linear(a, b).scalar_type(), torch::kBFloat16);
  EXPECT_EQ(F::mse_loss(torch::mm(a, b), b).scalar_type(), torch::kFloat);
  EXPECT_EQ(torch::relu(a).scalar_type(), torch::kFloat);  // not on any list
}

TEST(AutocastTest, OutsideTheGuardNothingIsCast) {
  auto a = torch::randn({4, 4});
  { AutocastGuard guard(torch::kCPU); }
  EXPECT_FALSE(ampx::is_autocast_enabled(torch::kCPU));
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kFloat);
}

TEST(AutocastTest, GradientsOfFp32ParamsStayFp32) {
  torch::manual_seed(0);
  torch::nn::Linear lin(8, 4);
  auto x = torch::randn({16, 8});
  torch::Tensor loss;
  {
    AutocastGuard guard(torch::kCPU);
    auto y = lin->forward(x);
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    loss = y.to(torch::kFloat).pow(2).mean();
  }
  loss.backward();
  EXPECT_EQ(lin->weight.grad().scalar_type(), torch::kFloat);
  EXPECT_EQ(lin->bias.grad().scalar_type(), torch::kFloat);
  EXPECT_GT(lin->weight.grad().abs().sum().item<float>(), 0.f);
  // The low-precision forward's gradient is the fp32 one to bf16 accuracy.
  lin->zero_grad();
  lin->forward(x).pow(2).mean().backward();
  auto ref = lin->weight.grad().clone();
  lin->zero_grad();
  {
    AutocastGuard guard(torch::kCPU);
    loss = lin->forward(x).to(torch::kFloat).pow(2).mean();
  }
  loss.backward();
  EXPECT_TRUE(torch::allclose(lin->weight.grad(), ref, 5e-2, 5e-2));
}

TEST(AutocastTest, NestedGuardsSaveAndRestoreLikePython) {
  const auto prev_dtype = ampx::get_autocast_dtype(torch::kCPU);
  auto a = torch::randn({4, 4});
  {
    AutocastGuard outer(torch::kCPU);
    EXPECT_TRUE(ampx::is_autocast_enabled(torch::kCPU));
    {
      AutocastGuard off(torch::kCPU, c10::nullopt, /*enabled=*/false);
      EXPECT_FALSE(ampx::is_autocast_enabled(torch::kCPU));
      EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kFloat);
      {
        AutocastGuard on_again(torch::kCPU);
        EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
      }
      EXPECT_FALSE(ampx::is_autocast_enabled(torch::kCPU));
    }
    EXPECT_TRUE(ampx::is_autocast_enabled(torch::kCPU));
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
  }
  EXPECT_FALSE(ampx::is_autocast_enabled(torch::kCPU));
  EXPECT_EQ(ampx::get_autocast_dtype(torch::kCPU), prev_dtype);
}

TEST(AutocastTest, InnerGuardWithoutDtypeInheritsOuterDtype) {
  if (!cpu_half_supported()) {
    GTEST_SKIP() << "needs two CPU autocast dtypes (LibTorch 2.x)";
  }
  AutocastGuard outer(torch::kCPU, torch::kHalf);
  AutocastGuard inner(torch::kCPU);  // Python: dtype defaults to the current one
  EXPECT_EQ(inner.dtype(), torch::kHalf);
  auto a = torch::randn({4, 4});
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kHalf);
}

TEST(AutocastTest, StateIsRestoredWhenAnExceptionLeavesTheRegion) {
  const bool prev_cache = ampx::is_autocast_cache_enabled();
  const auto prev_dtype = ampx::get_autocast_dtype(torch::kCPU);
  try {
    AutocastGuard guard(torch::kCPU, torch::kBFloat16, true, /*cache_enabled=*/!prev_cache);
    EXPECT_EQ(ampx::is_autocast_cache_enabled(), !prev_cache);
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(ampx::is_autocast_enabled(torch::kCPU));
  EXPECT_EQ(ampx::is_autocast_cache_enabled(), prev_cache);
  EXPECT_EQ(ampx::get_autocast_dtype(torch::kCPU), prev_dtype);
  // Nesting went back to 0: a new region starts at level 1.
  EXPECT_EQ(at::autocast::increment_nesting(), 1);
  EXPECT_EQ(at::autocast::decrement_nesting(), 0);
}

// The autograd node of the bf16 cast of the weight that `y` was computed
// from (found by walking y's graph). The same node for two outputs means the
// weight was cast once and the cast was cached.
const void* weight_cast_node(const torch::Tensor& y) {
  std::vector<torch::autograd::Node*> todo = {y.grad_fn().get()};
  while (!todo.empty()) {
    auto* node = todo.back();
    todo.pop_back();
    if (node == nullptr) continue;
    if (node->name().find("ToCopyBackward") != std::string::npos) return node;
    for (const auto& edge : node->next_edges()) todo.push_back(edge.function.get());
  }
  return nullptr;
}

// The cache holds low-precision copies of fp32 leaf weights that require
// grad, so a weight used twice in a region is cast once. Every output stays
// alive so that no node's address can be reused by a later one. (at::linear,
// not F::linear: LibTorch 1.13's F::linear computes weight.t() first, and the
// cast of that view is never cached; PyTorch caches leaves only.)
TEST(AutocastTest, WeightCastIsCachedAndClearedByTheOutermostGuard) {
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto x = torch::randn({4, 8});
  std::vector<torch::Tensor> alive;
  auto linear = [&] {
    alive.push_back(torch::linear(x, w));
    return weight_cast_node(alive.back());
  };
  const void* first = nullptr;
  {
    AutocastGuard outer(torch::kCPU);
    first = linear();
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(linear(), first) << "second use was cast again";
    {
      AutocastGuard inner(torch::kCPU);
      EXPECT_EQ(linear(), first);
    }
    EXPECT_EQ(linear(), first) << "an inner guard's exit must not clear the cache";
  }
  AutocastGuard again(torch::kCPU);
  const void* after = linear();
  ASSERT_NE(after, nullptr);
  EXPECT_NE(after, first) << "the outermost exit must clear the cache";
}

TEST(AutocastTest, CacheDisabledCastsEveryTime) {
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto x = torch::randn({4, 8});
  AutocastGuard guard(torch::kCPU, c10::nullopt, true, /*cache_enabled=*/false);
  auto y1 = torch::linear(x, w), y2 = torch::linear(x, w);
  ASSERT_NE(weight_cast_node(y1), nullptr);
  EXPECT_NE(weight_cast_node(y1), weight_cast_node(y2));
}

TEST(AutocastTest, RejectsBadDtypeNamingIt) {
  const auto text = ampx::test::error_text([] { AutocastGuard g(torch::kCPU, torch::kFloat); });
  EXPECT_THAT(text, HasSubstr("dtype must be float16 or bfloat16"));
  EXPECT_THAT(text, HasSubstr("Float"));
  EXPECT_FALSE(ampx::is_autocast_enabled(torch::kCPU));
}

TEST(AutocastTest, Fp16OnCpuIsAnErrorOnLibTorch113) {
  if (cpu_half_supported()) {
    AutocastGuard guard(torch::kCPU, torch::kHalf);
    auto a = torch::randn({4, 4});
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kHalf);
    return;
  }
  const auto text = ampx::test::error_text([] { AutocastGuard g(torch::kCPU, torch::kHalf); });
  EXPECT_THAT(text, HasSubstr("needs LibTorch 2.x"));
  EXPECT_THAT(text, HasSubstr("torch::kBFloat16"));
}

TEST(AutocastTest, CudaGuardWithoutCudaWarnsAndDisables) {
  if (torch::cuda::is_available()) {
    AutocastGuard guard(torch::kCUDA);
    EXPECT_TRUE(guard.enabled());
    auto a = torch::randn({4, 4}, torch::kCUDA);
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kHalf);
    return;
  }
  ampx::test::WarningCapture warnings;
  {
    AutocastGuard guard(torch::kCUDA);
    EXPECT_FALSE(guard.enabled());
    EXPECT_EQ(guard.dtype(), torch::kHalf);
  }
  // A training loop opens a guard every step: like Python's warnings filter
  // (once per call site), the warning is given once, not once per step. An
  // earlier test of this process may have had it already.
  for (int step = 0; step < 3; ++step) AutocastGuard guard(torch::kCUDA);
  EXPECT_LE(warnings.messages.size(), 1u);
  for (const auto& m : warnings.messages) EXPECT_THAT(m, HasSubstr("CUDA is not available"));
}

TEST(AutocastTest, CudaBf16AndFp16OpDtypes) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
  auto a = torch::randn({8, 8}, torch::kCUDA);
  for (auto dt : {torch::kHalf, torch::kBFloat16}) {
    AutocastGuard guard(torch::kCUDA, dt);
    EXPECT_EQ(torch::mm(a, a).scalar_type(), dt);
    EXPECT_EQ(torch::softmax(a, 1).scalar_type(), torch::kFloat);  // fp32 list on CUDA
    EXPECT_EQ(F::mse_loss(a, a).scalar_type(), torch::kFloat);
  }
}

torch::Tensor fp32_only_op(const torch::Tensor& x, const std::vector<torch::Tensor>& ws,
                           double alpha) {
  // Must see fp32 inputs and no autocast, like a custom kernel would need.
  EXPECT_FALSE(ampx::is_autocast_enabled(torch::kCPU));
  EXPECT_EQ(x.scalar_type(), torch::kFloat);
  for (const auto& w : ws) EXPECT_EQ(w.scalar_type(), torch::kFloat);
  return torch::mm(x, ws[0]) * alpha;
}

TEST(AutocastTest, CustomFwdCastsInputsAndDisablesAutocast) {
  auto x = torch::randn({4, 4}).to(torch::kBFloat16);
  auto w = torch::randn({4, 4});
  auto d = torch::randn({2}, torch::kDouble);
  {
    AutocastGuard guard(torch::kCPU);
    auto y = ampx::custom_fwd(torch::kCPU, torch::kFloat, fp32_only_op, x,
                              std::vector<torch::Tensor>{w.to(torch::kBFloat16)}, 2.0);
    EXPECT_EQ(y.scalar_type(), torch::kFloat);
    EXPECT_TRUE(ampx::is_autocast_enabled(torch::kCPU));  // restored after fn
    // float64 is never cast (Python's rule).
    auto same = ampx::custom_fwd(torch::kCPU, torch::kFloat,
                                 [](const torch::Tensor& t) { return t; }, d);
    EXPECT_EQ(same.scalar_type(), torch::kDouble);
  }
  // Outside autocast the function runs on its inputs untouched.
  auto plain = ampx::custom_fwd(torch::kCPU, torch::kFloat,
                                [](const torch::Tensor& t) { return t; }, x);
  EXPECT_EQ(plain.scalar_type(), torch::kBFloat16);
}

TEST(AutocastTest, GuardIsThreadLocal) {
  AutocastGuard guard(torch::kCPU);
  bool other_thread_enabled = true;
  std::thread t([&] { other_thread_enabled = ampx::is_autocast_enabled(torch::kCPU); });
  t.join();
  EXPECT_FALSE(other_thread_enabled);
  EXPECT_TRUE(ampx::is_autocast_enabled(torch::kCPU));
}

}  // namespace
