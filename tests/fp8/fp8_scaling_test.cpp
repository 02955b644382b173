// FP8 scaling recipes: TE's delayed scaling update rule (against a Python
// restatement of it, tests/reference/fp8_reference.py, and hand-derived
// sequences), current scaling, defaults, refusals, and state round trips.

#include "ampx/fp8.h"
#include "ampx/fp8/linear.h"

#include "../test_util.h"

#include <torch/serialize.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <sstream>

namespace {

using ampx::Direction;
using ampx::fp8::AmaxComputeAlgo;
using ampx::fp8::CurrentScaling;
using ampx::fp8::DelayedScaling;
using ampx::fp8::DelayedScalingState;
using ampx::fp8::Fp8Format;
using ampx::fp8::RecipeFormat;
using ampx::test::from_bits;
using ampx::test::to_bits;
using ::testing::HasSubstr;

torch::Tensor amax1(float a) {
  return torch::full({1}, a);
}

float scale_of(const DelayedScalingState& s) {
  return s.scale().item<float>();
}

std::vector<float> history_of(const DelayedScalingState& s) {
  const auto h = s.amax_history().contiguous();
  return std::vector<float>(h.data_ptr<float>(), h.data_ptr<float>() + h.numel());
}

TEST(Fp8ScalingTest, DefaultsAreTransformerEngines) {
  const DelayedScaling d;
  EXPECT_EQ(d.margin(), 0);
  EXPECT_EQ(d.fp8_format(), RecipeFormat::kHybrid);
  EXPECT_EQ(d.amax_history_len(), 1024);
  EXPECT_EQ(d.amax_compute_algo(), AmaxComputeAlgo::kMax);
  const CurrentScaling c;
  EXPECT_EQ(c.fp8_format(), RecipeFormat::kHybrid);
  EXPECT_FALSE(c.power_2_scale());
  EXPECT_EQ(c.amax_epsilon(), 0.0);
  // HYBRID: E4M3 forward, E5M2 backward.
  EXPECT_EQ(ampx::fp8::format_for(RecipeFormat::kHybrid, Direction::kForward), Fp8Format::kE4M3);
  EXPECT_EQ(ampx::fp8::format_for(RecipeFormat::kHybrid, Direction::kBackward), Fp8Format::kE5M2);
  EXPECT_EQ(ampx::fp8::format_for(RecipeFormat::kE4M3, Direction::kBackward), Fp8Format::kE4M3);
  const DelayedScalingState s(d, Direction::kBackward);
  EXPECT_EQ(s.format(), Fp8Format::kE5M2);
  EXPECT_EQ(scale_of(s), 1.0f);
  EXPECT_EQ(s.scale_inv().item<float>(), 1.0f);
  EXPECT_EQ(s.amax_history().numel(), 1024);
  EXPECT_EQ(s.amax_history().abs().sum().item<float>(), 0.0f);
}

TEST(Fp8ScalingTest, PureE5M2IsRefusedAsTransformerEngineRefusesIt) {
  const auto e5m2 = DelayedScaling().fp8_format(RecipeFormat::kE5M2);
  EXPECT_EQ(ampx::test::error_text([&] { DelayedScalingState s(e5m2, Direction::kForward); }),
            "DelayedScaling: pure E5M2 training is not supported (fp8_format must be E4M3 or "
            "HYBRID)");
  EXPECT_EQ(ampx::test::error_text([] {
              (void)ampx::fp8::quantize_current(torch::ones({2}),
                                                CurrentScaling().fp8_format(RecipeFormat::kE5M2),
                                                Direction::kBackward);
            }),
            "CurrentScaling: pure E5M2 training is not supported (fp8_format must be E4M3 or "
            "HYBRID)");
  // Pure E4M3 is allowed.
  DelayedScalingState s(DelayedScaling().fp8_format(RecipeFormat::kE4M3), Direction::kBackward);
  EXPECT_EQ(s.format(), Fp8Format::kE4M3);
  EXPECT_THAT(ampx::test::error_text([] {
                DelayedScalingState(DelayedScaling().amax_history_len(0), Direction::kForward);
              }),
              HasSubstr("DelayedScaling: amax_history_len must be >= 1, got 0"));
}

// Hand-derived, TE's layout: slot 0 zeroed, newest amax last, window = the
// last L amaxes. E4M3, L = 3, max: scale = 448 / max(window).
TEST(Fp8ScalingTest, HistoryRollsAndMaxTakesTheWindowsLargest) {
  DelayedScalingState s(DelayedScaling().amax_history_len(3).fp8_format(RecipeFormat::kE4M3),
                        Direction::kForward);
  s.update(amax1(2.0f));  // window {0, 0, 2}
  EXPECT_EQ(history_of(s), (std::vector<float>{0, 0, 2}));
  EXPECT_EQ(scale_of(s), 224.0f);  // 448 / 2
  EXPECT_EQ(s.scale_inv().item<float>(), 1.0f / 224.0f);
  s.update(amax1(8.0f));  // window {0, 2, 8}
  EXPECT_EQ(history_of(s), (std::vector<float>{0, 2, 8}));
  EXPECT_EQ(scale_of(s), 56.0f);  // 448 / 8
  s.update(amax1(1.0f));          // window {2, 8, 1}
  EXPECT_EQ(history_of(s), (std::vector<float>{0, 8, 1}));
  EXPECT_EQ(scale_of(s), 56.0f);
  s.update(amax1(4.0f));  // window {8, 1, 4}: 8 is still in it
  EXPECT_EQ(history_of(s), (std::vector<float>{0, 1, 4}));
  EXPECT_EQ(scale_of(s), 56.0f);
  s.update(amax1(0.5f));  // window {1, 4, 0.5}: 8 has rolled out
  EXPECT_EQ(history_of(s), (std::vector<float>{0, 4, 0.5f}));
  EXPECT_EQ(scale_of(s), 112.0f);  // 448 / 4
}

TEST(Fp8ScalingTest, MostRecentFollowsTheLastAmaxOnly) {
  DelayedScalingState s(
      DelayedScaling().amax_history_len(3).amax_compute_algo(AmaxComputeAlgo::kMostRecent),
      Direction::kBackward);  // HYBRID backward: E5M2, max 57344
  s.update(amax1(8.0f));
  EXPECT_EQ(scale_of(s), 7168.0f);  // 57344 / 8
  s.update(amax1(0.5f));
  EXPECT_EQ(scale_of(s), 114688.0f);  // 57344 / 0.5, although 8 is in the window
  EXPECT_EQ(history_of(s), (std::vector<float>{0, 8, 0.5f}));
}

TEST(Fp8ScalingTest, MarginDividesTheScaleByTwoToTheMargin) {
  for (int64_t margin : {0, 1, 3}) {
    DelayedScalingState s(DelayedScaling().margin(margin).amax_history_len(4), Direction::kForward);
    s.update(amax1(3.0f));
    EXPECT_EQ(scale_of(s), 448.0f / std::ldexp(1.0f, static_cast<int>(margin)) / 3.0f)
        << "margin " << margin;
    EXPECT_EQ(s.scaled_max(), 448.0f / std::ldexp(1.0f, static_cast<int>(margin)));
  }
}

TEST(Fp8ScalingTest, ZeroAmaxChangesNothingAndNonFiniteAmaxKeepsTheScale) {
  DelayedScalingState s(DelayedScaling().amax_history_len(2), Direction::kForward);
  s.update(amax1(4.0f));
  EXPECT_EQ(scale_of(s), 112.0f);
  const auto before = history_of(s);
  s.update(amax1(0.0f));  // no roll, no new scale
  EXPECT_EQ(history_of(s), before);
  EXPECT_EQ(scale_of(s), 112.0f);
  s.update(amax1(INFINITY));  // enters the history; max is inf: scale kept
  EXPECT_EQ(history_of(s), (std::vector<float>{0, INFINITY}));
  EXPECT_EQ(scale_of(s), 112.0f);
  s.update(amax1(2.0f));  // inf still in the window
  EXPECT_EQ(scale_of(s), 112.0f);
  s.update(amax1(2.0f));  // inf rolled out
  EXPECT_EQ(scale_of(s), 224.0f);
  s.update(amax1(NAN));  // max ignores NaN (fmaxf): window {2, NaN} -> 2
  EXPECT_EQ(scale_of(s), 224.0f);
  EXPECT_TRUE(std::isnan(history_of(s)[1]));
  s.update(amax1(1.0f));  // window {NaN, 1}: 1, not NaN
  EXPECT_EQ(scale_of(s), 448.0f);
  // most_recent: a NaN or inf amax keeps the previous scale.
  DelayedScalingState r(
      DelayedScaling().amax_history_len(2).amax_compute_algo(AmaxComputeAlgo::kMostRecent),
      Direction::kForward);
  r.update(amax1(8.0f));
  r.update(amax1(NAN));
  EXPECT_EQ(scale_of(r), 56.0f);
  r.update(amax1(INFINITY));
  EXPECT_EQ(scale_of(r), 56.0f);
  // An amax so small that 448 / amax overflows float32: FLT_MAX.
  r.update(amax1(1e-42f));
  EXPECT_EQ(scale_of(r), FLT_MAX);
  EXPECT_EQ(r.scale_inv().item<float>(), 1.0f / FLT_MAX);
}

TEST(Fp8ScalingTest, DelayedScalingMatchesTeRuleRestatedInPython) {
  const auto ref = ampx::test::load_reference("fp8_scaling.json");
  ASSERT_TRUE(ref.contains("delayed"));
  int cases = 0;
  for (const auto& c : ref["delayed"]) {
    const auto recipe = DelayedScaling()
                            .amax_history_len(c["history_len"].get<int64_t>())
                            .margin(c["margin"].get<int64_t>())
                            .amax_compute_algo(c["algo"] == "max" ? AmaxComputeAlgo::kMax
                                                                  : AmaxComputeAlgo::kMostRecent);
    const Direction pass = c["format"] == "e4m3" ? Direction::kForward : Direction::kBackward;
    DelayedScalingState s(recipe, pass);
    const auto& amaxes = c["amax"];
    const auto& steps = c["steps"];
    ASSERT_EQ(amaxes.size(), steps.size());
    for (size_t i = 0; i < amaxes.size(); ++i) {
      s.update(amax1(from_bits(amaxes[i].get<uint32_t>())));
      const auto& want = steps[i];
      const std::string where = c["format"].get<std::string>() +
                                " L=" + std::to_string(recipe.amax_history_len()) + " " +
                                c["algo"].get<std::string>() + " margin " +
                                std::to_string(recipe.margin()) + " step " + std::to_string(i);
      ASSERT_EQ(to_bits(scale_of(s)), want["scale"].get<uint32_t>()) << where;
      ASSERT_EQ(to_bits(s.scale_inv().item<float>()), want["scale_inv"].get<uint32_t>()) << where;
      const auto h = history_of(s);
      for (size_t k = 0; k < h.size(); ++k) {
        ASSERT_EQ(to_bits(h[k]), want["history"][k].get<uint32_t>()) << where << " slot " << k;
      }
    }
    ++cases;
  }
  EXPECT_GT(cases, 100);
}

TEST(Fp8ScalingTest, CurrentScaleMatchesTeComputeScaleFromAmax) {
  const auto ref = ampx::test::load_reference("fp8_scaling.json");
  ASSERT_TRUE(ref.contains("current"));
  for (const auto& c : ref["current"]) {
    const auto recipe = CurrentScaling()
                            .power_2_scale(c["power_2_scale"].get<bool>())
                            .amax_epsilon(from_bits(c["amax_epsilon"].get<uint32_t>()));
    const Fp8Format f = c["format"] == "e4m3" ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
    for (size_t i = 0; i < c["amax"].size(); ++i) {
      const float a = from_bits(c["amax"][i].get<uint32_t>());
      const float got = ampx::fp8::current_scale(amax1(a), f, recipe).item<float>();
      ASSERT_EQ(to_bits(got), c["scale"][i].get<uint32_t>())
          << c["format"] << " amax " << a << " pow2 " << recipe.power_2_scale() << " eps "
          << recipe.amax_epsilon();
    }
  }
}

TEST(Fp8ScalingTest, CurrentScalingMapsTheTensorsAmaxToTheFormatsMax) {
  const auto x = torch::tensor({0.5f, -3.0f, 1.25f, 0.0f});
  const auto q = ampx::fp8::quantize_current(x, CurrentScaling(), Direction::kForward);
  EXPECT_EQ(q.format, Fp8Format::kE4M3);
  EXPECT_EQ(q.scale.item<float>(), 448.0f / 3.0f);
  EXPECT_EQ(q.scale_inv.item<float>(), 1.0f / (448.0f / 3.0f));
  EXPECT_EQ(q.codes[1].item<int>(), 0xFE);  // -448
  const auto g = ampx::fp8::quantize_current(x, CurrentScaling(), Direction::kBackward);
  EXPECT_EQ(g.format, Fp8Format::kE5M2);
  EXPECT_EQ(g.codes[1].item<int>(), 0xFB);  // -57344
  // All zeros: scale 1, as TE.
  const auto z =
      ampx::fp8::quantize_current(torch::zeros({3}), CurrentScaling(), Direction::kForward);
  EXPECT_EQ(z.scale.item<float>(), 1.0f);
  // Power-of-two scales round down: 448 / 3 = 149.33 -> 128.
  const auto p =
      ampx::fp8::quantize_current(x, CurrentScaling().power_2_scale(true), Direction::kForward);
  EXPECT_EQ(p.scale.item<float>(), 128.0f);
}

std::string save_state(const DelayedScalingState& s) {
  torch::serialize::OutputArchive archive;
  s.save(archive, "fp8.layer0.input");
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

void load_state(DelayedScalingState& s, const std::string& bytes) {
  torch::serialize::InputArchive archive;
  std::istringstream in(bytes);
  archive.load_from(in);
  s.load(archive, "fp8.layer0.input");
}

TEST(Fp8ScalingTest, StateRoundTripsBitwiseAndContinuesIdentically) {
  const auto recipe = DelayedScaling().amax_history_len(5).margin(1);
  DelayedScalingState a(recipe, Direction::kForward);
  for (float v : {3.0f, 0.1f, 7.7f, NAN, 1e-30f, 2.5f}) a.update(amax1(v));
  const std::string bytes = save_state(a);
  DelayedScalingState b(recipe, Direction::kForward);
  load_state(b, bytes);
  auto same_bits = [](const torch::Tensor& x, const torch::Tensor& y) {
    return x.view(torch::kInt).equal(y.view(torch::kInt));
  };
  EXPECT_TRUE(same_bits(a.amax_history(), b.amax_history()));
  EXPECT_TRUE(same_bits(a.scale(), b.scale()));
  EXPECT_TRUE(same_bits(a.scale_inv(), b.scale_inv()));
  for (float v : {0.3f, 11.0f, 0.0f, 4.0f}) {
    a.update(amax1(v));
    b.update(amax1(v));
    EXPECT_TRUE(same_bits(a.scale(), b.scale()));
    EXPECT_TRUE(same_bits(a.amax_history(), b.amax_history()));
  }
  // A state saved under another recipe is not silently taken.
  DelayedScalingState other(DelayedScaling().amax_history_len(4).margin(1), Direction::kForward);
  EXPECT_THAT(ampx::test::error_text([&] { load_state(other, bytes); }),
              HasSubstr("DelayedScalingState.load: the saved amax history has 5 entries but this "
                        "recipe's amax_history_len is 4"));
  DelayedScalingState backward(recipe, Direction::kBackward);
  EXPECT_THAT(
      ampx::test::error_text([&] { load_state(backward, bytes); }),
      HasSubstr("DelayedScalingState.load: the saved state is e4m3 but this state is e5m2"));
}

TEST(Fp8ScalingTest, CudaUpdateMatchesCpuWithoutLeavingTheDevice) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
  const auto recipe = DelayedScaling().amax_history_len(4);
  DelayedScalingState cpu(recipe, Direction::kForward);
  DelayedScalingState cuda(recipe, Direction::kForward, torch::Device(torch::kCUDA));
  for (float v : {3.0f, 0.0f, INFINITY, 0.25f, NAN, 1e-42f, 9.0f}) {
    cpu.update(amax1(v));
    cuda.update(amax1(v).cuda());
    EXPECT_TRUE(cuda.scale().is_cuda());
    EXPECT_TRUE(cuda.scale().cpu().view(torch::kInt).equal(cpu.scale().view(torch::kInt)));
    EXPECT_TRUE(
        cuda.amax_history().cpu().view(torch::kInt).equal(cpu.amax_history().view(torch::kInt)));
  }
}


// A float32 tensor's bit patterns (int32), for comparisons that tell NaNs
// and signed zeros apart.
at::Tensor tensor_bits(const at::Tensor& t) {
  return t.to(torch::kFloat).contiguous().view(torch::kInt);
}

// The CUDA casts (src/fp8/cuda/cast_kernels.cu): one pass gives the codes,
// their transpose and the amax, and the states move as the CPU's do, bit
// for bit, for every input dtype, both formats and both recipes, on shapes
// that fill no 32 x 32 tile and on NaN and inf.
TEST(Fp8ScalingTest, CudaCastGivesCodesTransposeAndAmaxInOnePassAsTheCpu) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
  using ampx::fp8::Recipe;
  using ampx::fp8::TensorScaling;
  const std::vector<std::vector<int64_t>> shapes = {{1, 1}, {33, 65}, {128, 768}, {1000, 17}};
  const Recipe recipes[] = {DelayedScaling().amax_history_len(8), CurrentScaling(),
                            CurrentScaling().power_2_scale(true)};
  int64_t case_index = 0;
  for (const auto& shape : shapes) {
    for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
      for (const Recipe& recipe : recipes) {
        for (Direction pass : {Direction::kForward, Direction::kBackward}) {
          SCOPED_TRACE(recipe.to_string() + " " + c10::toString(dtype) + " " +
                       std::to_string(shape[0]) + "x" + std::to_string(shape[1]));
          torch::manual_seed(++case_index);
          auto x = (torch::randn(shape) * 300).to(dtype);
          if (case_index % 5 == 0) x.view(-1)[0] = INFINITY;
          if (case_index % 7 == 0) x.view(-1)[x.numel() - 1] = NAN;
          auto cpu = std::make_shared<TensorScaling>(recipe, pass, torch::kCPU);
          auto gpu = std::make_shared<TensorScaling>(recipe, pass, torch::kCUDA);
          for (int step = 0; step < 2; ++step) {  // the second casts with the first's scale
            at::Tensor transposed;
            const auto want = cpu->cast(x, /*record=*/true, nullptr);
            const auto got = gpu->cast(x.cuda(), /*record=*/true, nullptr, &transposed);
            ASSERT_TRUE(got.codes.is_cuda() && transposed.is_cuda());
            EXPECT_TRUE(got.codes.cpu().equal(want.codes)) << "step " << step;
            EXPECT_TRUE(transposed.cpu().equal(want.codes.t().contiguous())) << "step " << step;
            EXPECT_TRUE(tensor_bits(got.scale_inv.cpu()).equal(tensor_bits(want.scale_inv)));
            EXPECT_TRUE(tensor_bits(gpu->last_amax().cpu()).equal(tensor_bits(cpu->last_amax())));
            EXPECT_TRUE(tensor_bits(gpu->scale().cpu()).equal(tensor_bits(cpu->scale())));
            for (size_t i = 0; i < cpu->state_tensors().size(); ++i) {
              EXPECT_TRUE(tensor_bits(gpu->state_tensors()[i].second.cpu())
                              .equal(tensor_bits(cpu->state_tensors()[i].second)))
                  << cpu->state_tensors()[i].first;
            }
          }
        }
      }
    }
  }
}

// In a region on CUDA the delayed-scaling states move once, at its end, in
// one launch for every state (TE's fused amax and scale update), and the
// output gradients' at the end of the backward: after each step the states
// are the CPU's, whose updates come cast by cast. History lengths 1, 16 and
// 1500 (longer than a block of the update kernel), max and most_recent.
TEST(Fp8ScalingTest, CudaRegionUpdatesEveryStateInOneLaunchAsTheCpuDoes) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
  using ampx::fp8::Linear;
  using ampx::fp8::LinearOptions;
  const DelayedScaling recipes[] = {
      DelayedScaling().amax_history_len(1), DelayedScaling().amax_history_len(16),
      DelayedScaling().amax_history_len(1500).amax_compute_algo(AmaxComputeAlgo::kMostRecent)};
  torch::manual_seed(11);
  std::vector<Linear> cpu, gpu;
  for (const auto& r : recipes) {
    cpu.emplace_back(LinearOptions(32, 32).recipe(r));
    gpu.emplace_back(LinearOptions(32, 32).recipe(r));
    ampx::test::copy_params(*cpu.back(), *gpu.back());
    gpu.back()->to(torch::kCUDA);
  }
  const auto run = [](std::vector<Linear>& layers, const at::Tensor& x) {
    at::Tensor y = x;
    ampx::fp8::Fp8AutocastGuard fp8;
    for (auto& l : layers) y = l->forward(y).to(torch::kFloat);
    return y;
  };
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto x = torch::randn({64, 32}) * (step == 2 ? 0.0 : step + 1.0);  // step 2: all zero
    const auto history_before = gpu[1]->input_state().amax_history().cpu();
    at::Tensor yg;
    {
      at::Tensor y = x.cuda();
      ampx::fp8::Fp8AutocastGuard fp8;
      for (auto& l : gpu) y = l->forward(y).to(torch::kFloat);
      // Not yet: the region's updates wait for its end.
      EXPECT_TRUE(gpu[1]->input_state().amax_history().cpu().equal(history_before));
      yg = y;
    }
    const at::Tensor yc = run(cpu, x);
    yc.sum().backward();
    yg.sum().backward();
    for (size_t i = 0; i < cpu.size(); ++i) {
      const auto& c = cpu[i]->buffers();
      const auto& g = gpu[i]->buffers();
      ASSERT_EQ(c.size(), g.size());
      for (size_t b = 0; b < c.size(); ++b) {
        EXPECT_TRUE(tensor_bits(g[b].cpu()).equal(tensor_bits(c[b]))) << "layer " << i << " buffer " << b;
      }
    }
  }
}

}  // namespace
