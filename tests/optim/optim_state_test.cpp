// ampx::optim's moments in fewer bits (StateFormat): each format's step
// against a float64 reference within the format's bound, the 8-bit maps and
// their fast search, torchao's quantizers on the wheel leg, bf16's rounding,
// bytes per parameter (optim_state_training_test.cpp: Kahan weights, skips,
// resume, refusals).

#include "ampx/optim.h"

#include "../test_util.h"
#include "ampx/detail/optim_state.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {
namespace state_test {  // (unity builds: apart from the other tests' helpers)

namespace aopt = ampx::optim;
using ampx::test::from_bits;
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
      case StateFormat::kFp8: {  // nearest E4M3 of x / s: half an ulp, or half the quantum
                                 // 2^-9; a second moment under it at least the quantum
        const double s = std::max(absmax, 1e-12) / 448;
        bound +=
            std::ldexp(std::fabs(x[k]), -4) + std::ldexp(s, is_signed ? -10 : -9) + 1e-6 * s * 448;
        break;
      }
      case StateFormat::kInt8: {  // the nearest map value of x / s, times s
        const double s = std::max(absmax, 1e-12);
        double nearest = std::numeric_limits<double>::infinity();
        for (double q : map) nearest = std::min(nearest, std::fabs(q * s - x[k]));
        // A positive second moment at least the map's smallest value (map[1]).
        if (!is_signed && x[k] > 0) nearest = std::max(nearest, map[1] * s);
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
