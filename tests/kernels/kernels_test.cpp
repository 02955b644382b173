// The unscale and scale-update kernels: ampx's CPU kernels, the composite
// (device-generic) versions and ATen's own (where the build has them) must
// agree element for element, on real infs and NaNs.

#include "ampx/detail/kernels.h"
#include "ampx/kernels.h"
#include "ampx/policy.h"
#include "ampx/version.h"

#include "../test_util.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <random>

namespace {

using ::testing::HasSubstr;

using ampx::ScaleUpdateRule;

// What the kernel must produce: every element times inv_scale, computed in
// float (double for float64) and rounded to the gradient's dtype.
torch::Tensor expected_unscaled(const torch::Tensor& g, float inv) {
  if (g.scalar_type() == torch::kDouble) {
    return g * static_cast<double>(inv);
  }
  return (g.to(torch::kFloat) * inv).to(g.scalar_type());
}

void expect_same(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  // equal() treats NaN != NaN: compare NaN masks, then the rest bitwise.
  auto nan_got = torch::isnan(got.to(torch::kDouble)),
       nan_want = torch::isnan(want.to(torch::kDouble));
  ASSERT_TRUE(torch::equal(nan_got, nan_want)) << what;
  ASSERT_TRUE(torch::equal(got.masked_fill(nan_got, 0), want.masked_fill(nan_want, 0))) << what;
}

using UnscaleFn = void (*)(at::TensorList, at::Tensor&, const at::Tensor&);

void check_against_definition(UnscaleFn fn, const std::string& name,
                              torch::Device device = torch::kCPU) {
  std::mt19937 rng(7);
  const std::vector<torch::ScalarType> dtypes = {torch::kFloat, torch::kDouble, torch::kBFloat16,
                                                 torch::kHalf};
  const std::vector<int64_t> sizes = {1, 15, 16, 17, 1000, 65536 + 3, 300001};
  const float inv = 1.0f / 65536.0f;
  for (auto dtype : dtypes) {
    for (auto n : sizes) {
      for (int poison = 0; poison < 4; ++poison) {  // none, +inf, -inf, nan
        auto g = (torch::randn({n}) * 1000).to(dtype).to(device);
        if (poison > 0) {
          const int64_t at = std::uniform_int_distribution<int64_t>(0, n - 1)(rng);
          const double v = poison == 1   ? std::numeric_limits<double>::infinity()
                           : poison == 2 ? -std::numeric_limits<double>::infinity()
                                         : std::numeric_limits<double>::quiet_NaN();
          g[at] = v;
        }
        const auto want = expected_unscaled(g, inv).cpu();
        auto found = torch::zeros({1}, device);
        auto work = g.clone();
        fn({work}, found, torch::full({1}, inv, device));
        work = work.cpu();
        const std::string what = name + " " + c10::toString(dtype) + " n=" + std::to_string(n) +
                                 " poison=" + std::to_string(poison);
        expect_same(work, want, what);
        EXPECT_EQ(found.item<float>(), poison > 0 ? 1.f : 0.f) << what;
      }
    }
  }
}

template <ampx::detail::cpu::Isa kIsa>
void unscale_with(at::TensorList grads, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  ampx::detail::cpu::non_finite_check_and_unscale_(grads, found_inf, inv_scale, kIsa);
}

// The kernels that pick their build themselves (norms, fused optimizers) run
// best_isa(): the CPU's best, or the lower one ATEN_CPU_CAPABILITY asks for,
// as ATen's own kernels do. ctest's kernels.isa_default and kernels.isa_avx2
// run this test and those kernels' tests under each: here they check that
// the variable took.
TEST(CpuIsaTest, RunsTheBuildAtenCpuCapabilityAsks) {
  using ampx::detail::cpu::Isa;
  const Isa hardware = ampx::detail::cpu::supported_isas().back();
  Isa want = hardware;
  if (const char* asked = std::getenv("ATEN_CPU_CAPABILITY")) {
    const std::string a = asked;
    const Isa named = a == "default"  ? Isa::kDefault
                      : a == "avx2"   ? Isa::kAvx2
                      : a == "avx512" ? Isa::kAvx512
                                      : Isa::kAvx512Bf16;
    if (static_cast<int>(named) < static_cast<int>(want)) want = named;
  }
  EXPECT_EQ(ampx::detail::cpu::isa_name(ampx::detail::cpu::best_isa()),
            ampx::detail::cpu::isa_name(want));
}

TEST(KernelsTest, CpuUnscaleMatchesDefinitionForEveryDtypeAndIsa) {
  using ampx::detail::cpu::Isa;
  const auto isas = ampx::detail::cpu::supported_isas();
  check_against_definition(&unscale_with<Isa::kDefault>, "cpu default");
  if (isas.size() > 1) check_against_definition(&unscale_with<Isa::kAvx2>, "cpu avx2");
  if (isas.size() > 2) check_against_definition(&unscale_with<Isa::kAvx512>, "cpu avx512");
  std::cout << "checked " << isas.size() << " CPU kernel builds, best: "
            << ampx::detail::cpu::isa_name(ampx::detail::cpu::best_isa()) << "\n";
}

TEST(KernelsTest, CompositeUnscaleMatchesDefinition) {
  check_against_definition(&ampx::detail::non_finite_check_and_unscale_composite_, "composite");
}

TEST(KernelsTest, PublicUnscaleMatchesDefinition) {
  check_against_definition(&ampx::non_finite_check_and_unscale_, "public");
}

TEST(KernelsTest, CudaUnscaleMatchesDefinitionIncludingBf16) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
  // float/double/half go to ATen's CUDA kernel, bfloat16 to the composite.
  check_against_definition(&ampx::non_finite_check_and_unscale_, "cuda", torch::kCUDA);
}

TEST(KernelsTest, CpuUnscaleAgreesWithAtenWhereAtenHasACpuKernel) {
  auto g = torch::randn({100000});
  g[1234] = std::numeric_limits<float>::infinity();
  auto mine = g.clone(), theirs = g.clone();
  auto f1 = torch::zeros({1}), f2 = torch::zeros({1});
  auto inv = torch::full({1}, 0.125f);
  ampx::detail::cpu::non_finite_check_and_unscale_({mine}, f1, inv);
  try {
    at::_amp_foreach_non_finite_check_and_unscale_({theirs}, f2, inv);
  } catch (const c10::Error&) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no CPU _amp_foreach kernel";
  }
  expect_same(mine, theirs, "cpu vs aten");
  EXPECT_EQ(f1.item<float>(), f2.item<float>());
}

TEST(KernelsTest, ManySmallGradsAcrossThreadsFindTheOneInf) {
  std::vector<torch::Tensor> grads;
  for (int i = 0; i < 2000; ++i) {
    grads.push_back(torch::randn({37}));  // 74k elements in all: the parallel path
  }
  grads[1500][20] = std::numeric_limits<float>::quiet_NaN();
  std::vector<torch::Tensor> want;
  for (auto& g : grads) want.push_back(expected_unscaled(g, 0.5f));
  auto found = torch::zeros({1});
  ampx::detail::cpu::non_finite_check_and_unscale_(grads, found, torch::full({1}, 0.5f));
  EXPECT_EQ(found.item<float>(), 1.f);
  for (size_t i = 0; i < grads.size(); ++i) expect_same(grads[i], want[i], std::to_string(i));
}

TEST(KernelsTest, FoundInfIsNeverResetAndEmptyGradsAreFine) {
  auto found = torch::ones({1});
  auto g = torch::ones({10});
  ampx::detail::cpu::non_finite_check_and_unscale_({g, torch::empty({0})}, found,
                                                   torch::full({1}, 0.5f));
  EXPECT_EQ(found.item<float>(), 1.f);
  EXPECT_TRUE(torch::equal(g, torch::full({10}, 0.5f)));
}

TEST(KernelsTest, NonContiguousAndPermutedGrads) {
  auto base = torch::randn({64, 64});
  base[3][5] = std::numeric_limits<float>::infinity();
  auto strided = base.clone();
  auto view = strided.slice(1, 0, 64, 2);  // gapped: not dense
  auto want_view = expected_unscaled(view, 0.25f);
  auto found = torch::zeros({1});
  ampx::detail::cpu::non_finite_check_and_unscale_({view}, found, torch::full({1}, 0.25f));
  expect_same(view, want_view, "gapped view");
  EXPECT_EQ(found.item<float>(), 0.f) << "the inf sits in a column the view skips";
  // The untouched columns stay as they were.
  EXPECT_TRUE(torch::equal(strided.slice(1, 1, 64, 2), base.slice(1, 1, 64, 2)));

  auto permuted = base.clone().t();  // dense, not contiguous
  auto want_perm = expected_unscaled(permuted, 0.25f);
  ampx::detail::cpu::non_finite_check_and_unscale_({permuted}, found, torch::full({1}, 0.25f));
  expect_same(permuted, want_perm, "permuted");
  EXPECT_EQ(found.item<float>(), 1.f);
}

TEST(KernelsTest, UnscaleArgumentErrorsNameTheArgument) {
  auto g = torch::ones({4});
  auto found = torch::zeros({1});
  auto text = ampx::test::error_text([&] {
    auto bad = torch::zeros({1}, torch::kDouble);
    ampx::non_finite_check_and_unscale_({g}, bad, torch::ones({1}));
  });
  EXPECT_THAT(text, HasSubstr("found_inf must be a float tensor, got Double"));
  text = ampx::test::error_text(
      [&] { ampx::non_finite_check_and_unscale_({g}, found, torch::ones({2})); });
  EXPECT_THAT(text, HasSubstr("inv_scale must be a 1-element tensor, got 2 elements"));
  text = ampx::test::error_text([&] {
    ampx::non_finite_check_and_unscale_({g, torch::ones({2}, torch::kInt)}, found,
                                        torch::ones({1}));
  });
  EXPECT_THAT(text, HasSubstr("grads[1] must be float32, float64, float16 or bfloat16, got Int"));
}

struct ScaleState {
  torch::Tensor scale = torch::full({}, 65536.f);
  torch::Tensor growth = torch::zeros({}, torch::kInt);
  torch::Tensor hyst;
  explicit ScaleState(const ScaleUpdateRule& rule, float s = 65536.f)
      : scale(torch::full({}, s)), hyst(torch::full({}, rule.hysteresis, torch::kInt)) {}
};

TEST(KernelsTest, UpdateBacksOffGrowsAndResets) {
  ScaleUpdateRule rule;
  rule.growth_interval = 3;
  ScaleState st(rule);
  auto clean = torch::zeros({}), inf = torch::ones({});
  ampx::detail::cpu::update_scale_(st.scale, st.growth, st.hyst, clean, rule);
  ampx::detail::cpu::update_scale_(st.scale, st.growth, st.hyst, clean, rule);
  EXPECT_EQ(st.scale.item<float>(), 65536.f);
  EXPECT_EQ(st.growth.item<int>(), 2);
  ampx::detail::cpu::update_scale_(st.scale, st.growth, st.hyst, clean, rule);
  EXPECT_EQ(st.scale.item<float>(), 131072.f);
  EXPECT_EQ(st.growth.item<int>(), 0);
  ampx::detail::cpu::update_scale_(st.scale, st.growth, st.hyst, clean, rule);
  ampx::detail::cpu::update_scale_(st.scale, st.growth, st.hyst, inf, rule);
  EXPECT_EQ(st.scale.item<float>(), 65536.f);
  EXPECT_EQ(st.growth.item<int>(), 0);
}

TEST(KernelsTest, UpdateNeverGrowsToInf) {
  ScaleUpdateRule rule;
  rule.growth_interval = 1;
  const float big = std::ldexp(1.f, 127);
  ScaleState st(rule, big);
  ampx::detail::cpu::update_scale_(st.scale, st.growth, st.hyst, torch::zeros({}), rule);
  EXPECT_EQ(st.scale.item<float>(), big);
  EXPECT_EQ(st.growth.item<int>(), 0);
}

TEST(KernelsTest, HysteresisAbsorbsOverflowsUntilGrowthRefillsIt) {
  ScaleUpdateRule rule;
  rule.growth_interval = 2;
  rule.hysteresis = 3;
  ScaleState st(rule, 1024.f);
  auto inf = torch::ones({}), clean = torch::zeros({});
  auto upd = [&](const torch::Tensor& f) {
    ampx::detail::cpu::update_scale_(st.scale, st.growth, st.hyst, f, rule);
    return st.scale.item<float>();
  };
  EXPECT_EQ(upd(inf), 1024.f);  // absorbed (3 -> 2)
  EXPECT_EQ(upd(inf), 1024.f);  // absorbed (2 -> 1)
  EXPECT_EQ(upd(inf), 512.f);   // third consecutive: back off
  EXPECT_EQ(upd(inf), 256.f);   // exhausted: every overflow backs off
  EXPECT_EQ(upd(clean), 256.f);
  EXPECT_EQ(upd(clean), 512.f);  // growth refills hysteresis
  EXPECT_EQ(st.hyst.item<int>(), 3);
  EXPECT_EQ(upd(inf), 512.f);
}

TEST(KernelsTest, BoundsClampTheScale) {
  ScaleUpdateRule rule;
  rule.growth_interval = 1;
  rule.min_scale = 4.0;
  rule.max_scale = 16.0;
  ScaleState st(rule, 8.f);
  auto upd = [&](float f) {
    ampx::detail::cpu::update_scale_(st.scale, st.growth, st.hyst, torch::full({}, f), rule);
    return st.scale.item<float>();
  };
  EXPECT_EQ(upd(0), 16.f);
  EXPECT_EQ(upd(0), 16.f);
  EXPECT_EQ(upd(1), 8.f);
  EXPECT_EQ(upd(1), 4.f);
  EXPECT_EQ(upd(1), 4.f);
}

TEST(KernelsTest, CompositeAndNativeUpdatesAgreeWithCpuKernelOnRandomSequences) {
  std::mt19937 rng(3);
  for (int64_t hysteresis : {1, 2}) {
    for (bool bounded : {false, true}) {
      ScaleUpdateRule rule;
      rule.growth_factor = 1.5;
      rule.backoff_factor = 0.7;
      rule.growth_interval = 3;
      rule.hysteresis = hysteresis;
      rule.min_scale = bounded ? c10::optional<double>(100.0) : c10::nullopt;
      rule.max_scale = bounded ? c10::optional<double>(1e6) : c10::nullopt;
      ScaleState a(rule), b(rule);
      for (int i = 0; i < 400; ++i) {
        auto found = torch::full({}, std::bernoulli_distribution(0.3)(rng) ? 1.f : 0.f);
        ampx::detail::cpu::update_scale_(a.scale, a.growth, a.hyst, found, rule);
        ampx::detail::update_scale_composite_(b.scale, b.growth, b.hyst, found, rule);
        ASSERT_EQ(a.scale.item<float>(), b.scale.item<float>()) << "step " << i;
        ASSERT_EQ(a.growth.item<int>(), b.growth.item<int>()) << "step " << i;
        ASSERT_EQ(a.hyst.item<int>(), b.hyst.item<int>()) << "step " << i;
      }
    }
  }
}

TEST(KernelsTest, CudaUpdateAgreesWithCpuKernelOnRandomSequences) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
  std::mt19937 rng(5);
  for (int64_t hysteresis : {1, 3}) {  // ATen's kernel + clamp, then the composite
    ScaleUpdateRule rule;
    rule.growth_interval = 2;
    rule.hysteresis = hysteresis;
    rule.min_scale = 1.0;
    rule.max_scale = 1e5;
    ScaleState a(rule), b(rule);
    b.scale = b.scale.cuda();
    b.growth = b.growth.cuda();
    b.hyst = b.hyst.cuda();
    for (int i = 0; i < 300; ++i) {
      const float f = std::bernoulli_distribution(0.35)(rng) ? 1.f : 0.f;
      ampx::detail::cpu::update_scale_(a.scale, a.growth, a.hyst, torch::full({}, f), rule);
      ampx::update_scale_(b.scale, b.growth, b.hyst, torch::full({}, f, torch::kCUDA), rule);
      ASSERT_EQ(a.scale.item<float>(), b.scale.item<float>()) << "step " << i;
      ASSERT_EQ(a.growth.item<int>(), b.growth.item<int>()) << "step " << i;
      if (hysteresis > 1) {
        ASSERT_EQ(a.hyst.item<int>(), b.hyst.item<int>()) << "step " << i;
      }
    }
  }
}

TEST(KernelsTest, UpdateArgumentErrors) {
  ScaleUpdateRule rule;
  ScaleState st(rule);
  auto bad_tracker = torch::zeros({}, torch::kLong);
  const auto text = ampx::test::error_text(
      [&] { ampx::update_scale_(st.scale, bad_tracker, st.hyst, torch::zeros({}), rule); });
  EXPECT_THAT(text,
              HasSubstr("growth_tracker must be a 1-element int32 tensor, got 1 elements of Long"));
}

}  // namespace
