// KeepNormsFp32Guard and Fp32RegionGuard (the cast policies they are made
// of: policy_test.cpp): which ops modules enter through, norms kept in fp32
// under bf16 inputs, every other op left alone, restoring after exceptions.
// Expectations are what each LibTorch version does, checked on real ops.

#include "ampx/policy.h"

#include "ampx/autocast.h"
#include "policy_fixture.h"

#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <stdexcept>

namespace policy_test {
namespace {

using ampx::AutocastGuard;
using ampx::CastPolicy;
using ampx::CastPolicyGuard;

// conv2d of a (4, 8) input reshaped to an image, with an fp32 weight.
torch::Tensor F_conv(const torch::Tensor& x) {
  return torch::conv2d(x.reshape({1, 1, 4, 8}), torch::ones({2, 1, 3, 3}));
}

TEST_F(PolicyTest, ModulesEnterThroughTheTopLevelNormOps) {
  // kFp32 on one op alone: an fp32 result shows the module's call met it.
  auto x = rnd({2, 4, 3, 3}, torch::kBFloat16);
  auto check = [&](const char* op, auto&& forward) {
    AutocastGuard autocast(torch::kCPU);
    CastPolicyGuard policy(torch::kCPU, {{op, CastPolicy::kFp32}});
    EXPECT_EQ(forward().scalar_type(), torch::kFloat) << op;
  };
  torch::NoGradGuard no_grad;
  check("aten::batch_norm", [&] { return torch::nn::BatchNorm2d(4)->forward(x); });
  check("aten::layer_norm",
        [&] { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({3}))->forward(x); });
  check("aten::group_norm", [&] { return torch::nn::GroupNorm(2, 4)->forward(x); });
  check("aten::instance_norm", [&] { return torch::nn::InstanceNorm2d(4)->forward(x); });
  auto norms = ampx::norm_ops();
  EXPECT_NE(std::find(norms.begin(), norms.end(), "aten::native_batch_norm"), norms.end());
}

// bf16 input into an fp32 norm module: bf16 out, values of the fp32 module on
// the same (bf16-rounded) input, fp32 weight grads, bf16 input grads.
template <class Module>
void expect_norm_kept_fp32(Module module, torch::Tensor x32) {
  for (auto& p : module->parameters()) p.mutable_grad() = torch::Tensor();
  auto x = x32.to(torch::kBFloat16).requires_grad_();
  auto ref_in = x.detach().to(torch::kFloat).requires_grad_();
  auto ref_module = std::dynamic_pointer_cast<typename Module::ContainedType>(module->clone());
  auto ref = ref_module->forward(ref_in);
  torch::Tensor y;
  {
    ampx::KeepNormsFp32Guard keep(torch::kCPU);
    y = module->forward(x);
  }
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::allclose(y.to(torch::kFloat), ref, 1e-2, 2e-2));
  y.to(torch::kFloat).square().sum().backward();
  ref.square().sum().backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().scalar_type(), torch::kBFloat16);
  for (const auto& p : module->parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
  }
  EXPECT_TRUE(torch::allclose(module->parameters()[0].grad(), ref_module->parameters()[0].grad(),
                              5e-2, 5e-2));
}

TEST_F(PolicyTest, KeepNormsFp32BatchNormTrainAndEval) {
  auto bn = torch::nn::BatchNorm2d(4);
  auto x = rnd({4, 4, 5, 5}) * 3 + 1;
  expect_norm_kept_fp32(bn, x);
  // Training updated the fp32 running stats in place.
  EXPECT_EQ(bn->running_mean.scalar_type(), torch::kFloat);
  EXPECT_GT(bn->running_mean.abs().sum().item<float>(), 0.f);
  EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 1);
  bn->eval();
  expect_norm_kept_fp32(bn, x);
}

TEST_F(PolicyTest, KeepNormsFp32LayerNormAndGroupNorm) {
  expect_norm_kept_fp32(torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})), rnd({4, 8}));
  expect_norm_kept_fp32(torch::nn::GroupNorm(2, 4), rnd({2, 4, 3, 3}));
}

TEST_F(PolicyTest, KeepNormsFp32LeavesEveryOtherOpAlone) {
  torch::nn::Linear linear(8, 4);
  linear->to(torch::kBFloat16);
  auto x = rnd({2, 8});
  ampx::KeepNormsFp32Guard keep(torch::kCPU);
  EXPECT_TRUE(ampx::is_autocast_enabled(torch::kCPU));
  // Under PyTorch's autocast these would be bf16 (mm) and fp32 (l1_loss).
  EXPECT_EQ(torch::mm(x, x.t()).scalar_type(), torch::kFloat);
  EXPECT_EQ(linear->forward(x.to(torch::kBFloat16)).scalar_type(), torch::kBFloat16);
  EXPECT_EQ(torch::l1_loss(x.to(torch::kBFloat16), x.to(torch::kBFloat16)).scalar_type(),
            torch::kBFloat16);
  EXPECT_EQ(torch::conv2d(rnd({1, 2, 4, 4}), rnd({3, 2, 3, 3})).scalar_type(), torch::kFloat);
}

TEST_F(PolicyTest, KeepNormsFp32RestoresAfterException) {
  auto a = rnd({4, 4});
  try {
    ampx::KeepNormsFp32Guard keep(torch::kCPU);
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(ampx::is_autocast_enabled(torch::kCPU));
  AutocastGuard autocast(torch::kCPU);
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
  // A user policy alive before the guard is back after it.
  CastPolicyGuard policy(torch::kCPU, {{"aten::mm", CastPolicy::kFp32}});
  { ampx::KeepNormsFp32Guard keep(torch::kCPU); }
  EXPECT_EQ(ampx::get_cast_policy(torch::kCPU, "aten::mm"), CastPolicy::kFp32);
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kFloat);
}

// The guard's scan of the dispatcher is kept between guards (it costs about
// 0.4 ms): a policy set after the first guard, on an op PyTorch has no
// autocast kernel for, is still switched off inside later guards.
TEST_F(PolicyTest, KeepNormsFp32SeesPoliciesSetAfterItsFirstUse) {
  { ampx::KeepNormsFp32Guard keep(torch::kCPU); }
  auto a = rnd({2, 2}), b = rnd({2, 2});
  CastPolicyGuard policy(torch::kCPU, {{"ampx_test::scale_add", CastPolicy::kLowerPrecision}});
  auto call = [&] {
    return c10::Dispatcher::singleton()
        .findSchemaOrThrow("ampx_test::scale_add", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>()
        .call(a, b);
  };
  {
    AutocastGuard autocast(torch::kCPU);
    call();
    EXPECT_EQ(g_seen_a, at::kBFloat16);
  }
  ampx::KeepNormsFp32Guard keep(torch::kCPU);
  call();
  EXPECT_EQ(g_seen_a, at::kFloat);
}

// An operator defined after the first guard, with an autocast kernel of its
// own: later guards see it and switch that kernel off.
TEST_F(PolicyTest, KeepNormsFp32SeesOperatorsDefinedAfterItsFirstUse) {
  { ampx::KeepNormsFp32Guard keep(torch::kCPU); }
  torch::Library def(torch::Library::DEF, "ampx_late", c10::nullopt, __FILE__, __LINE__);
  def.def("mark(Tensor x) -> Tensor");
  torch::Library cpu(torch::Library::IMPL, "ampx_late", c10::DispatchKey::CPU, __FILE__, __LINE__);
  cpu.impl("mark", [](const at::Tensor& x) { return x.clone(); });
  torch::Library autocast_impl(torch::Library::IMPL, "ampx_late", c10::DispatchKey::AutocastCPU,
                               __FILE__, __LINE__);
  autocast_impl.impl("mark", [](const at::Tensor& x) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
    return x.to(at::kBFloat16);  // what an autocast kernel of its own would do
  });
  const auto mark = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("ampx_late::mark", "")
                        .typed<at::Tensor(const at::Tensor&)>();
  auto x = rnd({2, 2});
  {
    AutocastGuard autocast(torch::kCPU);
    EXPECT_EQ(mark.call(x).scalar_type(), torch::kBFloat16);
  }
  ampx::KeepNormsFp32Guard keep(torch::kCPU);
  EXPECT_EQ(mark.call(x).scalar_type(), torch::kFloat);
}

TEST_F(PolicyTest, Fp32RegionInsideAutocast) {
  auto a = rnd({4, 8}), w = rnd({3, 8});
  auto low = a.to(torch::kBFloat16);
  torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({8}));
  AutocastGuard autocast(torch::kCPU);
  EXPECT_EQ(torch::linear(low, w).scalar_type(), torch::kBFloat16);
  {
    ampx::Fp32RegionGuard fp32(torch::kCPU);
    EXPECT_TRUE(ampx::is_autocast_enabled(torch::kCPU));
    auto y = torch::linear(low, w);
    EXPECT_EQ(y.scalar_type(), torch::kFloat);
    EXPECT_EQ(torch::mm(low, low.t()).scalar_type(), torch::kFloat);
    EXPECT_EQ(torch::matmul(low, w.t()).scalar_type(), torch::kFloat);
    EXPECT_EQ(ln->forward(low).scalar_type(), torch::kFloat);
    EXPECT_EQ(F_conv(low).scalar_type(), torch::kFloat);
    // Ops autocast leaves alone stay as they come.
    EXPECT_EQ(torch::relu(low).scalar_type(), torch::kBFloat16);
    AutocastGuard off(torch::kCPU, c10::nullopt, /*enabled=*/false);
    EXPECT_TRUE(torch::allclose(y, torch::linear(low.to(torch::kFloat), w)));
  }
  EXPECT_EQ(torch::linear(low, w).scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(ampx::get_all_cast_policies(torch::kCPU).empty());
  try {
    ampx::Fp32RegionGuard fp32(torch::kCPU);
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(ampx::is_autocast_enabled(torch::kCPU));
  EXPECT_EQ(torch::linear(low, w).scalar_type(), torch::kBFloat16);
}

TEST_F(PolicyTest, CudaKeepNormsFp32) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "CUDA not available";
  torch::nn::BatchNorm2d bn(4);
  bn->to(torch::kCUDA);
  torch::nn::Linear linear(8, 4);
  linear->to(torch::kCUDA, torch::kHalf);
  auto x = rnd({2, 4, 3, 3}).cuda().to(torch::kHalf).requires_grad_();
  ampx::KeepNormsFp32Guard keep(torch::kCUDA);
  auto y = bn->forward(x);
  EXPECT_EQ(y.scalar_type(), torch::kHalf);
  EXPECT_EQ(linear->forward(rnd({2, 8}).cuda().to(torch::kHalf)).scalar_type(), torch::kHalf);
  EXPECT_EQ(torch::mm(rnd({2, 2}).cuda(), rnd({2, 2}).cuda()).scalar_type(), torch::kFloat);
  y.to(torch::kFloat).sum().backward();
  EXPECT_EQ(x.grad().scalar_type(), torch::kHalf);
  EXPECT_EQ(bn->weight.grad().scalar_type(), torch::kFloat);
}

TEST_F(PolicyTest, CudaFp32Region) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "CUDA not available";
  auto low = rnd({4, 8}).cuda().to(torch::kHalf), w = rnd({3, 8}).cuda();
  AutocastGuard autocast(torch::kCUDA);
  ampx::Fp32RegionGuard fp32(torch::kCUDA);
  EXPECT_EQ(torch::linear(low, w).scalar_type(), torch::kFloat);
  EXPECT_EQ(torch::softmax(low, 1).scalar_type(), torch::kFloat);
}

}  // namespace
}  // namespace policy_test
