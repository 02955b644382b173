// ampx::optim's moments in fewer bits (StateFormat) and Kahan-compensated
// weights: each format's step against a float64 reference within the
// format's bound, torchao's quantizers on the wheel leg, skipped steps that
// touch nothing, bitwise resume, refused mismatches, bytes per parameter.

#include "ampx/optim.h"

#include "ampx/detail/optim_state.h"
#include "ampx/grad_scaler.h"
#include "test_util.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {
namespace state_test {  // (unity builds: apart from the other tests' helpers)

namespace aopt = ampx::optim;
using ampx::test::error_text;
using ampx::test::from_bits;
using ampx::test::load_from_string;
using ampx::test::same_bits;
using ampx::test::save_to_string;
using aopt::StateFormat;

constexpr StateFormat kLowBit[] = {StateFormat::kBf16, StateFormat::kFp8, StateFormat::kInt8};

// The dynamic tree map from its definition (bitsandbytes; torchao's
// create_dynamic_map(signed, 7, 8)), in double: the test's own derivation,
// torchao's map itself on the wheel leg (DynamicMapsAndCodesAreTorchaos).
std::vector<double> dynamic_map_definition(bool is_signed) {
  std::vector<double> v;
  for (int i = 0; i < 7; ++i) {
    const int n = is_signed ? (1 << i) : (1 << (i + 1));
    for (int j = 0; j < n; ++j) {
      const double mean = (0.1 + 0.9 * (j + 0.5) / n) * std::pow(10.0, i - 6);
      v.push_back(mean);
      if (is_signed) v.push_back(-mean);
    }
  }
  v.push_back(0.0);
  v.push_back(1.0);
  std::sort(v.begin(), v.end());
  return v;
}

// --- one step against float64 ---------------------------------------------------

enum class Update { kAdamW, kLamb, kSgd };
const char* update_name(Update u) {
  return u == Update::kAdamW ? "AdamW" : u == Update::kLamb ? "LAMB" : "SGD";
}

std::unique_ptr<aopt::MixedPrecisionOptimizer> make_optimizer(Update u, const torch::Tensor& p,
                                                              StateFormat format) {
  switch (u) {
    case Update::kAdamW:
      return std::make_unique<aopt::AdamW>(
          std::vector<torch::Tensor>{p},
          aopt::AdamWOptions(1e-2).weight_decay(0.1).state_format(format));
    case Update::kLamb:
      return std::make_unique<aopt::LAMB>(
          std::vector<torch::Tensor>{p},
          aopt::LAMBOptions(1e-2).weight_decay(0.1).state_format(format));
    case Update::kSgd:
      return std::make_unique<aopt::SGD>(std::vector<torch::Tensor>{p},
                                         aopt::SGDOptions(1e-2).momentum(0.9).state_format(format));
  }
  return nullptr;
}

// A step's gradient for 5000 elements (19 blocks of 256 and a partial one):
// normal values but for block 0 (zeros), block 1 (one large value among
// small ones) and block 2 (subnormal floats).
torch::Tensor edge_grad(int64_t step) {
  auto g = at::detail::createCPUGenerator(300 + step);
  auto grad = at::randn({5000}, g) * 0.1;
  grad.narrow(0, 0, 256).zero_();
  grad.narrow(0, 256, 256).mul_(1e-3);
  grad[300] = 1e3;
  grad.narrow(0, 512, 256).mul_(1e-39);
  return grad;
}

// The largest deviation, over a block's elements, of a decoded moment from
// its exact value beyond what `format` may lose there (<= 0: within bound).
double excess_over_bound(StateFormat format, bool is_signed, const torch::Tensor& decoded,
                         const torch::Tensor& exact, const torch::Tensor& terms) {
  const auto* d = decoded.data_ptr<double>();
  const auto* x = exact.data_ptr<double>();
  const auto* t = terms.data_ptr<double>();
  const int64_t n = exact.numel();
  double absmax = 0;
  for (int64_t k = 0; k < n; ++k) absmax = std::max(absmax, std::fabs(x[k]));
  const auto map = dynamic_map_definition(is_signed);
  double worst = -1;
  for (int64_t k = 0; k < n; ++k) {
    const double err = std::fabs(d[k] - x[k]);
    // The kernel's fp32 moments underflow where the exact ones are below
    // fp32's subnormals (the subnormal gradients' squares).
    // And the kernel's fp32 moment is the exact one within a few ulps of
    // the terms it adds (they may cancel): 1e-6 of their magnitudes.
    double bound = std::ldexp(1.0, -146) + 1e-6 * t[k];
    switch (format) {
      case StateFormat::kBf16:  // stochastic: below one ulp, <= 2^-7 |x|, or bf16's
                                // subnormal quantum 2^-133
        bound += std::ldexp(std::fabs(x[k]) + 1e-6 * t[k], -7) + std::ldexp(1.0, -133);
        break;
      case StateFormat::kFp8: {  // nearest E4M3 of x / s: half an ulp, or half the quantum 2^-9
        const double s = std::max(absmax, 1e-12) / 448;
        bound += std::ldexp(std::fabs(x[k]), -4) + std::ldexp(s, -10) + 1e-6 * s * 448;
        break;
      }
      case StateFormat::kInt8: {  // the nearest map value of x / s, times s
        const double s = std::max(absmax, 1e-12);
        double nearest = std::numeric_limits<double>::infinity();
        for (double q : map) nearest = std::min(nearest, std::fabs(q * s - x[k]));
        bound += nearest + 1e-6 * s;
        break;
      }
      case StateFormat::kFp32:
        break;
    }
    worst = std::max(worst, err - bound);
  }
  return worst;
}

double excess_over_blocks(StateFormat format, bool is_signed, const torch::Tensor& decoded,
                          const torch::Tensor& exact, const torch::Tensor& terms) {
  double worst = -1;
  const int64_t n = exact.numel();
  for (int64_t b = 0; b < n; b += 256) {
    const int64_t len = std::min<int64_t>(256, n - b);
    worst = std::max(worst, excess_over_bound(format, is_signed, decoded.narrow(0, b, len),
                                              exact.narrow(0, b, len), terms.narrow(0, b, len)));
  }
  return worst;
}

TEST(OptimStateTest, EachFormatsStepFollowsADoubleReferenceWithinItsBound) {
  for (const auto format : kLowBit) {
    for (const auto update : {Update::kAdamW, Update::kLamb, Update::kSgd}) {
      SCOPED_TRACE(std::string(aopt::state_format_name(format)) + " " + update_name(update));
      auto g = at::detail::createCPUGenerator(77);
      auto p = (at::randn({5000}, g) * 0.5).requires_grad_();
      auto opt = make_optimizer(update, p, format);
      const double lr = 1e-2, wd = 0.1, b1 = 0.9, b2 = 0.999, mom = 0.9;
      const double eps = update == Update::kLamb ? 1e-6 : 1e-8;
      auto m = torch::zeros({5000}, torch::kDouble), v = torch::zeros({5000}, torch::kDouble);
      for (int64_t step = 1; step <= 4; ++step) {
        const auto w = p.detach().to(torch::kDouble);
        const auto grad = edge_grad(step);
        p.mutable_grad() = grad.clone();
        const auto gd = grad.to(torch::kDouble);
        opt->step();
        // The new moments, exactly, from the state as stored before the step.
        torch::Tensor m_new, v_new, w_ref;
        const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
        if (update == Update::kSgd) {
          m_new = step == 1 ? gd : m * mom + gd;
          w_ref = w - lr * m_new;
        } else {
          m_new = m * b1 + gd * (1 - b1);
          v_new = v * b2 + gd * gd * (1 - b2);
        }
        const auto m_dec = opt->exp_avg(p).to(torch::kDouble);
        const auto m_terms =
            update == Update::kSgd ? m.abs() * mom + gd.abs() : m.abs() * b1 + gd.abs() * (1 - b1);
        EXPECT_LE(excess_over_blocks(format, true, m_dec, m_new, m_terms), 0.0) << "step " << step;
        torch::Tensor v_dec;
        if (update != Update::kSgd) {
          v_dec = opt->exp_avg_sq(p).to(torch::kDouble);
          EXPECT_LE(excess_over_blocks(format, false, v_dec, v_new, v_new), 0.0) << "step " << step;
        }
        if (update == Update::kAdamW) {
          // The weight from the new moments before their encoding, as torchao's.
          w_ref = w * (1 - lr * wd) - (lr / bc1) * m_new / ((v_new.sqrt() / std::sqrt(bc2)) + eps);
        } else if (update == Update::kLamb) {
          // The trust ratio of the update applied: from the moments as stored.
          const auto u = (m_dec / bc1) / ((v_dec / bc2).sqrt() + eps) + wd * w;
          const double ratio = (w.norm() / u.norm()).item<double>();
          w_ref = w - lr * ratio * u;
        }
        // fp32 arithmetic: a few ulps of the weight (up to 40 where the large
        // gradient moved it).
        const double werr = ((p.detach().to(torch::kDouble) - w_ref).abs() - 4e-7 * w_ref.abs())
                                .max()
                                .item<double>();
        EXPECT_LE(werr, 2e-6) << "step " << step;
        m = m_dec;
        if (v_dec.defined()) v = v_dec;
      }
    }
  }
}

// --- the 8-bit maps ---------------------------------------------------------------

TEST(OptimStateTest, DynamicMapsAreTheirDefinitionRoundedOnce) {
  for (const bool is_signed : {true, false}) {
    const auto ours = aopt::detail::state_dynamic_map(is_signed);
    const auto exact = dynamic_map_definition(is_signed);
    ASSERT_EQ(ours.size(), 256u);
    for (size_t c = 0; c < 256; ++c) {
      EXPECT_EQ(ours[c], static_cast<float>(exact[c])) << "code " << c << " signed " << is_signed;
    }
    // Zero has a code: an all-zero block decodes to zeros exactly.
    EXPECT_EQ(ours[is_signed ? 127 : 0], 0.0f);
    EXPECT_EQ(ours[255], 1.0f);
  }
}

TEST(OptimStateTest, FastCodesAreTheBinarySearchsForEveryFloat16Prefix) {
  // The step's encoder starts from a table indexed by a float's top 16 bits:
  // every prefix, with its lowest, highest, middle and a random low half,
  // and every map value, midpoint and their float neighbours.
  for (const bool is_signed : {true, false}) {
    const auto map = aopt::detail::state_dynamic_map(is_signed);
    std::vector<float> xs;
    uint32_t lcg = 12345;
    for (uint32_t b = 0; b < (1u << 16); ++b) {
      lcg = lcg * 1664525u + 1013904223u;
      for (uint32_t low : {0u, 0xFFFFu, 0x8000u, lcg >> 16})
        xs.push_back(from_bits((b << 16) | low));
    }
    for (size_t c = 0; c + 1 < map.size(); ++c) {
      const float mid = (map[c] + map[c + 1]) / 2;
      for (float v : {map[c], mid}) {
        xs.push_back(v);
        xs.push_back(std::nextafter(v, 2.0f));
        xs.push_back(std::nextafter(v, -2.0f));
      }
    }
    int64_t differ = 0;
    for (const float x : xs) {
      differ += aopt::detail::state_dynamic_code(is_signed, x) !=
                aopt::detail::state_map_code(map.data(), x);
    }
    EXPECT_EQ(differ, 0) << "signed " << is_signed << " of " << xs.size();
  }
}

// --- torchao's quantizers (wheel leg) -------------------------------------------

TEST(OptimStateTest, DynamicMapsAndCodesAreTorchaos) {
  const auto ref = ampx::test::load_reference("optim_state_torchao.json");
  if (ref.is_null() || ref["torchao"].is_null()) {
    GTEST_SKIP() << "no torchao reference on this leg: "
                 << (ref.is_null() ? std::string("none written")
                                   : ref["reason"].get<std::string>());
  }
  RecordProperty("torchao_cpu_capability", ref["cpu_capability"].get<std::string>());
  // The maps: torchao's float32 steps round as its ISA's linspace does;
  // ampx's each value once from double. Within 2 ulps everywhere.
  for (const bool is_signed : {true, false}) {
    const auto theirs = ref[is_signed ? "qmap_signed" : "qmap_unsigned"];
    const auto ours = aopt::detail::state_dynamic_map(is_signed);
    ASSERT_EQ(theirs.size(), 256u);
    for (size_t c = 0; c < 256; ++c) {
      const float t = from_bits(theirs[c].get<uint32_t>());
      const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(ours[c]), 1e-30f)) - 23);
      EXPECT_LE(std::fabs(t - ours[c]), 2 * ulp) << "code " << c << " signed " << is_signed;
    }
  }
  // The codes of x with torchao's own maps: the search and the tie rule.
  std::vector<float> x;
  for (const auto& b : ref["x"]) x.push_back(from_bits(b.get<uint32_t>()));
  for (const bool is_signed : {true, false}) {
    std::vector<float> map;
    for (const auto& b : ref[is_signed ? "qmap_signed" : "qmap_unsigned"]) {
      map.push_back(from_bits(b.get<uint32_t>()));
    }
    const auto codes = ref[is_signed ? "codes_signed" : "codes_unsigned"];
    int64_t differ = 0;
    for (size_t k = 0; k < x.size(); ++k) {
      const float xi = is_signed ? x[k] : std::fabs(x[k]);
      if (aopt::detail::state_map_code(map.data(), xi) != codes[k].get<int>()) ++differ;
    }
    EXPECT_EQ(differ, 0) << "signed " << is_signed << " of " << x.size();
  }
  // FP8 state: scales and codes bit for bit.
  const int64_t block = ref["fp8_block"].get<int64_t>();
  std::vector<float> in;
  for (const auto& b : ref["fp8_input"]) in.push_back(from_bits(b.get<uint32_t>()));
  std::vector<float> scales;
  std::vector<uint8_t> codes;
  aopt::detail::fp8_state_quantize(in, block, scales, codes);
  ASSERT_EQ(scales.size(), ref["fp8_scales"].size());
  for (size_t b = 0; b < scales.size(); ++b) {
    EXPECT_EQ(ampx::test::to_bits(scales[b]), ref["fp8_scales"][b].get<uint32_t>())
        << "block " << b;
  }
  int64_t differ = 0;
  for (size_t k = 0; k < codes.size(); ++k) differ += codes[k] != ref["fp8_codes"][k].get<int>();
  EXPECT_EQ(differ, 0);
}

// --- the bf16 format's rounding -------------------------------------------------

TEST(OptimStateTest, Bf16SecondMomentDecaysWhereRoundingToNearestWouldStall) {
  // One gradient of 1, then zeros: v = 0.001 * 0.999^(t-1). Rounded to
  // nearest, 0.999 v is v again in bf16 (spacing 2^-8 .. 2^-7 relative) and v
  // never decays; rounded stochastically it decays on average.
  const int64_t n = 8192, steps = 500;
  auto p = torch::zeros({n}).requires_grad_();
  aopt::AdamW opt({p}, aopt::AdamWOptions(0.0).weight_decay(0.0).state_format(StateFormat::kBf16));
  p.mutable_grad() = torch::ones({n});
  opt.step();
  p.mutable_grad() = torch::zeros({n});
  for (int64_t s = 1; s < steps; ++s) opt.step();
  const double exact = 1e-3 * std::pow(0.999, steps - 1);  // 6.07e-4
  const double mean = opt.exp_avg_sq(p).mean().item<double>();
  EXPECT_NEAR(mean, exact, 0.02 * exact) << "rounded to nearest it would stay near 1e-3";
  RecordProperty("v_mean", std::to_string(mean));
}

// --- Kahan weights --------------------------------------------------------------

TEST(OptimStateTest, KahanStepIsTheFp32UpdateSplitIntoWeightAndLostBits) {
  // SGD without momentum: w = (p + c) - lr * (g + wd * (p + c)) in fp32;
  // then p = bf16(w), c = bf16(w - p), element by element.
  auto g = at::detail::createCPUGenerator(5);
  auto p = at::randn({3000}, g).to(torch::kBFloat16).requires_grad_();
  aopt::SGD opt(
      {p}, aopt::SGDOptions(1e-3).weight_decay(0.01).master_weights(false).kahan_summation(true));
  for (int s = 0; s < 5; ++s) {
    const auto grad = at::randn({3000}, g).to(torch::kBFloat16);
    p.mutable_grad() = grad;
    const auto c = opt.compensation(p);
    const auto w0 = c.defined() ? p.detach().to(torch::kFloat) + c.to(torch::kFloat)
                                : p.detach().to(torch::kFloat);
    const auto gf = grad.to(torch::kFloat);
    const auto w = w0 + (gf + w0 * 0.01f) * -1e-3f;
    opt.step();
    const auto p_exp = w.to(torch::kBFloat16);
    const auto c_exp = (w - p_exp.to(torch::kFloat)).to(torch::kBFloat16);
    EXPECT_TRUE(torch::equal(p.detach(), p_exp)) << "step " << s;
    EXPECT_TRUE(torch::equal(opt.compensation(p), c_exp)) << "step " << s;
  }
}

// y = x w* regression with a bf16 Linear; `mode` 0: fp32 masters, 1: Kahan,
// 2: nearest rounding of the bf16 weight. The eval loss after 400 SGD steps.
double kahan_regression(int mode) {
  auto g = at::detail::createCPUGenerator(21);
  const auto w_star = at::randn({64, 1}, g);
  const auto x = at::randn({256, 64}, g), y = x.matmul(w_star);
  const auto x_eval = at::randn({512, 64}, g), y_eval = x_eval.matmul(w_star);
  torch::manual_seed(22);
  torch::nn::Linear lin(64, 1);
  {
    torch::NoGradGuard no_grad;
    lin->weight.copy_(torch::randn({1, 64}));  // |w| ~ 1: bf16 spacing 2^-7 .. 2^-6
  }
  aopt::SGD opt(lin->parameters(),
                aopt::SGDOptions(1e-2).master_weights(mode == 0).kahan_summation(mode == 1));
  opt.capture_master_weights();
  for (auto& p : lin->parameters()) p.set_data(p.detach().to(torch::kBFloat16));
  for (int s = 0; s < 400; ++s) {
    opt.zero_grad();
    torch::mse_loss(lin(x.to(torch::kBFloat16)).to(torch::kFloat), y).backward();
    opt.step();
  }
  torch::NoGradGuard no_grad;
  auto weight = [&](const torch::Tensor& p) {
    if (mode == 0) return opt.master(p);
    if (mode == 1) return p.to(torch::kFloat) + opt.compensation(p).to(torch::kFloat);
    return p.to(torch::kFloat);
  };
  return torch::mse_loss(
             torch::nn::functional::linear(x_eval, weight(lin->weight), weight(lin->bias)), y_eval)
      .item<double>();
}

TEST(OptimStateTest, KahanWeightsTrainAsFp32MastersWhereRoundingToNearestStalls) {
  const double master = kahan_regression(0), kahan = kahan_regression(1),
               nearest = kahan_regression(2);
  EXPECT_LE(kahan, 1.05 * master + 1e-6) << "masters " << master << " nearest " << nearest;
  EXPECT_GE(nearest, 5 * kahan) << "masters " << master << " kahan " << kahan;
  RecordProperty("loss_masters", std::to_string(master));
  RecordProperty("loss_kahan", std::to_string(kahan));
  RecordProperty("loss_nearest", std::to_string(nearest));
}

// --- training, skipping, resuming -----------------------------------------------

using Net = ampx::test::Mlp;

// A bf16 MLP whose every param has coded moments (state_min_numel 0, blocks
// of 32: partial blocks everywhere) and Kahan weights.
struct LowBitRun {
  Net net{nullptr};
  std::unique_ptr<aopt::AdamW> opt;
  LowBitRun(StateFormat format, int64_t seed) {
    torch::manual_seed(seed);
    net = Net(48, /*float_output=*/true);
    opt = std::make_unique<aopt::AdamW>(net->parameters(), aopt::AdamWOptions(1e-2)
                                                               .master_weights(false)
                                                               .kahan_summation(true)
                                                               .state_format(format)
                                                               .state_block(32)
                                                               .state_min_numel(0));
    for (auto& p : net->parameters()) p.set_data(p.detach().to(torch::kBFloat16));
  }
  double step(int64_t s) {
    const auto b = ampx::test::make_batch(400 + s);
    opt->zero_grad();
    auto loss = torch::mse_loss(net->forward(b.x), b.y);
    loss.backward();
    opt->step();
    return loss.item<double>();
  }
};

TEST(OptimStateTest, InfGradientsLeaveCodesScalesAndCompensationsUntouched) {
  for (const auto format : kLowBit) {
    SCOPED_TRACE(aopt::state_format_name(format));
    LowBitRun run(format, 8);
    for (int s = 0; s < 3; ++s) run.step(s);
    ampx::GradScaler scaler(ampx::GradScalerOptions().init_scale(1024.0));
    const auto b = ampx::test::make_batch(9);
    run.opt->zero_grad();
    scaler.scale(torch::mse_loss(run.net->forward(b.x), b.y)).backward();
    run.net->parameters()[0].mutable_grad().view(-1)[3] = std::numeric_limits<float>::infinity();
    const auto before = ampx::test::full_state(*run.opt);
    const auto bytes = save_to_string(*run.opt);
    EXPECT_FALSE(scaler.step(*run.opt).stepped());
    EXPECT_TRUE(same_bits(before, ampx::test::full_state(*run.opt)));
    // Codes and scales too, as saved (the decoded moments could hide a
    // change of both).
    LowBitRun a(format, 8), b2(format, 8);
    load_from_string(*a.opt, bytes);
    load_from_string(*b2.opt, save_to_string(*run.opt));
    for (auto* r : {&a, &b2}) {
      torch::NoGradGuard no_grad;
      auto ps = r->net->parameters();
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(run.net->parameters()[i]);
    }
    a.step(20);
    b2.step(20);
    EXPECT_TRUE(same_bits(ampx::test::full_state(*a.opt), ampx::test::full_state(*b2.opt)));
  }
}

TEST(OptimStateTest, ResumeFromSavedLowBitStateIsBitwise) {
  for (const auto format : kLowBit) {
    SCOPED_TRACE(aopt::state_format_name(format));
    LowBitRun whole(format, 12);
    for (int s = 0; s < 12; ++s) whole.step(s);
    LowBitRun first(format, 12);
    for (int s = 0; s < 6; ++s) first.step(s);
    const auto bytes = save_to_string(*first.opt);
    LowBitRun resumed(format, 13);  // another init: everything comes from the state
    {
      torch::NoGradGuard no_grad;
      auto ps = resumed.net->parameters();
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(first.net->parameters()[i]);
    }
    load_from_string(*resumed.opt, bytes);
    for (int s = 6; s < 12; ++s) resumed.step(s);
    EXPECT_TRUE(
        same_bits(ampx::test::full_state(*whole.opt), ampx::test::full_state(*resumed.opt)));
  }
}

TEST(OptimStateTest, EveryFormatTrainsAsFp32Moments) {
  // 300 steps of the MLP regression over 50 batches: the mean loss of the
  // last pass over them, for each format within 5% of fp32 moments' (Kahan
  // weights throughout).
  auto final_loss = [](StateFormat format) {
    LowBitRun run(format, 3);
    double last_pass = 0;
    for (int s = 0; s < 300; ++s) {
      const double loss = run.step(s % 50);
      if (s >= 250) last_pass += loss / 50;
    }
    return last_pass;
  };
  const double fp32 = final_loss(StateFormat::kFp32);
  for (const auto format : kLowBit) {
    const double loss = final_loss(format);
    EXPECT_LE(loss, 1.05 * fp32) << aopt::state_format_name(format) << " vs fp32 " << fp32;
    RecordProperty(std::string("loss_") + aopt::state_format_name(format), std::to_string(loss));
  }
  RecordProperty("loss_fp32", std::to_string(fp32));
}

// --- refusals -------------------------------------------------------------------

TEST(OptimStateTest, AStateOfAnotherFormatBlockOrWeightIsRefusedNamingBoth) {
  LowBitRun int8(StateFormat::kInt8, 4);
  for (int s = 0; s < 2; ++s) int8.step(s);
  const auto before = ampx::test::full_state(*int8.opt);
  LowBitRun fp8(StateFormat::kFp8, 4);
  fp8.step(0);
  EXPECT_EQ(error_text([&] { load_from_string(*int8.opt, save_to_string(*fp8.opt)); }),
            "ampx::optim::AdamW::load: the state was saved with state_format fp8, this optimizer "
            "has state_format 8bit");
  auto net = int8.net;
  aopt::AdamW other_block(net->parameters(), aopt::AdamWOptions(1e-2)
                                                 .master_weights(false)
                                                 .kahan_summation(true)
                                                 .state_format(StateFormat::kInt8)
                                                 .state_block(64)
                                                 .state_min_numel(0));
  EXPECT_EQ(error_text([&] { load_from_string(*int8.opt, save_to_string(other_block)); }),
            "ampx::optim::AdamW::load: the state was saved with state_block 64, this optimizer "
            "has state_block 32");
  aopt::AdamW no_kahan(net->parameters(), aopt::AdamWOptions(1e-2)
                                              .master_weights(false)
                                              .state_format(StateFormat::kInt8)
                                              .state_block(32)
                                              .state_min_numel(0));
  EXPECT_EQ(error_text([&] { load_from_string(*int8.opt, save_to_string(no_kahan)); }),
            "ampx::optim::AdamW::load: the state was saved with kahan_summation(false), this "
            "optimizer has kahan_summation(true)");
  // A corrupt scale.
  {
    torch::serialize::OutputArchive out;
    int8.opt->save(out);
    std::ostringstream ss;
    out.save_to(ss);
    std::istringstream is(ss.str());
    torch::serialize::InputArchive in;
    in.load_from(is);
    torch::serialize::OutputArchive bad;
    for (const auto& key : in.keys()) {
      c10::IValue v;
      in.read(key, v);
      if (key == "group0.param0.exp_avg_scale") {
        auto t = v.toTensor().clone();
        t[1] = -1.0f;
        bad.write(key, t, /*is_buffer=*/true);
      } else if (v.isTensor()) {
        bad.write(key, v.toTensor(), /*is_buffer=*/true);
      } else {
        bad.write(key, v);
      }
    }
    std::ostringstream bs;
    bad.save_to(bs);
    EXPECT_EQ(error_text([&] { load_from_string(*int8.opt, bs.str()); }),
              "ampx::optim::AdamW::load: group0.param0.exp_avg_scale has a negative or non-finite "
              "scale");
  }
  EXPECT_TRUE(same_bits(before, ampx::test::full_state(*int8.opt)));
}

TEST(OptimStateTest, OptionsAreCheckedAndUnsupportedParamsRefused) {
  auto p = torch::zeros({8}, torch::kBFloat16).requires_grad_();
  EXPECT_EQ(error_text([&] { aopt::AdamW({p}, aopt::AdamWOptions().kahan_summation(true)); }),
            "ampx::optim: kahan_summation(true) keeps the lost low bits of bf16/fp16 params that "
            "have no fp32 master; it needs master_weights(false)");
  EXPECT_EQ(
      error_text([&] {
        aopt::AdamW(
            {p},
            aopt::AdamWOptions().master_weights(false).kahan_summation(true).stochastic_rounding(
                true));
      }),
      "ampx::optim: kahan_summation(true) and stochastic_rounding(true) are two ways to keep "
      "small updates of bf16 params; choose one");
  for (int64_t block : {16, 48, 8192}) {
    EXPECT_EQ(error_text([&] { aopt::AdamW({p}, aopt::AdamWOptions().state_block(block)); }),
              "ampx::optim: state_block must be a power of 2 in [32, 4096], got " +
                  std::to_string(block));
  }
  EXPECT_EQ(error_text([&] { aopt::state_format_from_name("int4"); }),
            "ampx::optim: unknown state format 'int4'; expected fp32, bf16, fp8 or 8bit");
  for (const auto f :
       {StateFormat::kFp32, StateFormat::kBf16, StateFormat::kFp8, StateFormat::kInt8}) {
    EXPECT_EQ(aopt::state_format_from_name(aopt::state_format_name(f)), f);
  }
  // A non-contiguous param takes the ATen path, which keeps fp32 moments.
  auto base = torch::zeros({64, 80});
  auto view = base.t().requires_grad_();
  aopt::AdamW opt({view}, aopt::AdamWOptions().state_format(StateFormat::kFp8));
  view.mutable_grad() = torch::ones({80, 64}).t().contiguous().t();
  EXPECT_EQ(error_text([&] { opt.step(); }),
            "ampx::optim::AdamW: state_format fp8 is implemented for dense CPU params and grads; "
            "param (group 0, index 0) is not contiguous");
}

// --- memory -----------------------------------------------------------------------

TEST(OptimStateTest, StateBytesPerParameterAreWhatEachFormatKeeps) {
  // Two bf16 params of 2^16 and 2^12 elements and one of 100 (below
  // state_min_numel: fp32 moments). Bytes as the tensors hold them.
  auto make = [] {
    return std::vector<torch::Tensor>{torch::zeros({256, 256}, torch::kBFloat16).requires_grad_(),
                                      torch::zeros({4096}, torch::kBFloat16).requires_grad_(),
                                      torch::zeros({100}, torch::kBFloat16).requires_grad_()};
  };
  auto bytes = [&](aopt::AdamWOptions o) {
    auto ps = make();
    aopt::AdamW opt(ps, o);
    for (auto& p : ps) p.mutable_grad() = torch::ones_like(p);
    opt.step();
    return opt.state_bytes();
  };
  const int64_t big = 65536 + 4096, small = 100;
  EXPECT_EQ(bytes(aopt::AdamWOptions()), (big + small) * 12);  // fp32 master, m, v
  EXPECT_EQ(bytes(aopt::AdamWOptions().master_weights(false).kahan_summation(true).state_format(
                StateFormat::kInt8)),
            (big + small) * 2 + big * 2 + (65536 / 256 + 4096 / 256) * 8 + small * 8);
  EXPECT_EQ(bytes(aopt::AdamWOptions().master_weights(false).stochastic_rounding(true).state_format(
                StateFormat::kBf16)),
            big * 4 + small * 8);
}

}  // namespace state_test
}  // namespace
