// Range statistics: the format limits against PyTorch's finfo and casts, the
// scan's counts against a double-precision reference and against c10's own
// conversions, and the collector's attribution to scopes, ops and directions.

#include "ampx/debug/range_stats.h"
#include "ampx/debug/formats.h"
#include "ampx/debug/scope.h"
#include "ampx/detail/compat.h"

#include "../test_util.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/version.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

namespace ampx {
namespace debug {
namespace {

using ampx::test::from_bits;
using ampx::test::to_bits;

TEST(FormatsTest, LimitsAndRoundingBoundariesMatchTorch) {
  const auto ref = test::load_reference("format_limits.json");
  const auto& formats = ref.at("formats");
  // The 1.13 leg's torch has no float8 dtypes; 2.1+ has both.
  EXPECT_EQ(formats.size(), AMPX_HAS_TORCH_FLOAT8 ? 4u : 2u) << ref.at("torch_version");
  for (const auto f : kAllFormats) {
    const auto& lim = format(f);
    if (!formats.contains(lim.name)) continue;
    const auto& t = formats.at(lim.name);
    SCOPED_TRACE(lim.name);
    EXPECT_EQ(lim.max, t.at("max").get<double>());
    EXPECT_EQ(lim.min_normal, t.at("tiny").get<double>());
    EXPECT_EQ(lim.min_subnormal, t.at("min_subnormal").get<double>());
    // torch's casts: the first float32 that overflows, the last that rounds
    // to zero, the first that rounds to a normal.
    const auto torch_overflow = t.at("overflow_from_bits").get<uint32_t>();
    if (torch_overflow == to_bits(std::numeric_limits<float>::infinity()) &&
        std::string(lim.name) == "float8_e4m3fn") {
      // Debian's torch 2.14 saturates float32 -> float8_e4m3fn (1e30 and inf
      // become 448), so no float32 overflows there; ampx's limit is the
      // non-saturating conversion (OCP's other mode), which the other legs'
      // torch implement. ampx's own FP8 casts clamp first either way.
      EXPECT_GT(to_bits(lim.overflow_from), to_bits(static_cast<float>(lim.max)));
    } else {
      EXPECT_EQ(to_bits(lim.overflow_from) + (lim.overflow_inclusive ? 0 : 1), torch_overflow);
    }
    EXPECT_EQ(to_bits(lim.zero_up_to), t.at("zero_up_to_bits").get<uint32_t>());
    EXPECT_EQ(to_bits(lim.normal_from), t.at("normal_from_bits").get<uint32_t>());
  }
}

// Every boundary of every format, one float32 ulp either side, plus random
// magnitudes over fp32's whole range (subnormals included), signs, zeros,
// infs and NaNs.
std::vector<float> probe_values() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::denorm_min(),
                          1.0f};
  for (const auto f : kAllFormats) {
    const auto& l = format(f);
    for (float b :
         {l.max, l.min_normal, l.min_subnormal, l.overflow_from, l.zero_up_to, l.normal_from}) {
      for (int d = -1; d <= 1; ++d) {
        const float x = from_bits(to_bits(b) + d);
        v.push_back(x);
        v.push_back(-x);
      }
    }
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any_finite(1, 0x7f7fffffu);
  std::uniform_real_distribution<double> log_mag(-30.0, 20.0);
  for (int i = 0; i < 100000; ++i) {
    const float x =
        (i % 2) ? from_bits(any_finite(rng)) : static_cast<float>(std::exp2(log_mag(rng)));
    v.push_back(i % 3 ? x : -x);
  }
  return v;
}

TEST(RangeStatsTest, ScanMatchesDoublePrecisionAndC10Casts) {
  const auto values = probe_values();
  const auto t = torch::tensor(values);
  const RangeRecord r = scan_range(t);

  RangeRecord want;
  want.numel = static_cast<int64_t>(values.size());
  double max = 0, min = std::numeric_limits<double>::infinity();
  for (const float x : values) {
    const double a = std::fabs(static_cast<double>(x));
    if (a == 0) {
      ++want.zeros;
      continue;
    }
    if (!std::isfinite(a)) {
      ++want.non_finite;
      continue;
    }
    max = std::max(max, a);
    min = std::min(min, a);
    ++want.histogram[std::ilogb(a) - RangeRecord::kMinExponent];
    for (size_t i = 0; i < kAllFormats.size(); ++i) {
      const auto& l = format(kAllFormats[i]);
      auto& c = want.formats[i];
      c.overflow += l.overflow_inclusive ? a >= l.overflow_from : a > l.overflow_from;
      c.to_zero += a <= l.zero_up_to;
      c.subnormal += a > l.zero_up_to && a < l.normal_from;
    }
    // c10's own conversions agree with the boundaries for fp16 and bf16.
    const float h = static_cast<float>(c10::Half(x));
    const float b = static_cast<float>(c10::BFloat16(x));
    ASSERT_EQ(std::isinf(h), a >= 65520.0) << x;
    ASSERT_EQ(h == 0, a <= format(Format::kFloat16).zero_up_to) << x;
    ASSERT_EQ(std::isinf(b), a >= format(Format::kBFloat16).overflow_from) << x;
    ASSERT_EQ(b == 0, a <= format(Format::kBFloat16).zero_up_to) << x;
    ASSERT_EQ(b != 0 && std::fabs(b) < format(Format::kBFloat16).min_normal,
              a > format(Format::kBFloat16).zero_up_to && a < format(Format::kBFloat16).normal_from)
        << x;
  }
  EXPECT_EQ(r.numel, want.numel);
  EXPECT_EQ(r.zeros, want.zeros);
  EXPECT_EQ(r.non_finite, want.non_finite);
  EXPECT_EQ(r.abs_max, max);
  EXPECT_EQ(r.min_nonzero, min);
  EXPECT_EQ(r.histogram, want.histogram);
  for (size_t i = 0; i < kAllFormats.size(); ++i) {
    SCOPED_TRACE(to_string(kAllFormats[i]));
    EXPECT_EQ(r.formats[i].overflow, want.formats[i].overflow);
    EXPECT_EQ(r.formats[i].to_zero, want.formats[i].to_zero);
    EXPECT_EQ(r.formats[i].subnormal, want.formats[i].subnormal);
    EXPECT_GT(r.formats[i].overflow, 0);
    EXPECT_GT(r.formats[i].to_zero, 0);
    EXPECT_GT(r.formats[i].subnormal, 0);
  }
}

TEST(RangeStatsTest, HalfBf16AndStridedTensorsCountTheirValues) {
  torch::manual_seed(0);
  const auto base =
      torch::randn({64, 96}) * torch::exp2(torch::randint(-30, 30, {64, 96}).to(torch::kFloat));
  for (auto dtype : {torch::kHalf, torch::kBFloat16, torch::kDouble}) {
    const auto low = base.to(dtype);
    const auto a = scan_range(low.t());  // non-contiguous
    const auto b = scan_range(low.to(torch::kFloat).contiguous());
    EXPECT_EQ(a.numel, b.numel);
    EXPECT_EQ(a.zeros, b.zeros);
    EXPECT_EQ(a.non_finite, b.non_finite);
    EXPECT_EQ(a.abs_max, b.abs_max);
    EXPECT_EQ(a.min_nonzero, b.min_nonzero);
    EXPECT_EQ(a.histogram, b.histogram);
    for (size_t i = 0; i < kAllFormats.size(); ++i)
      EXPECT_EQ(a.formats[i].overflow, b.formats[i].overflow);
  }
}

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    ModuleScopeGuard scope(*this);
    h = torch::relu(fc1->forward(x));
    return fc2->forward(h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor h;
};
TORCH_MODULE(Net);

const RangeRecord* find(const RangeStats& s, const std::string& scope, const std::string& op,
                        Direction d) {
  for (const auto& r : s.records) {
    if (r.scope == scope && r.op == op && r.direction == d) return &r;
  }
  return nullptr;
}

TEST(RangeStatsTest, CollectorAttributesActivationsAndGradientsToScopes) {
  torch::manual_seed(0);
  Net net;
  name_modules(*net, "net");
  const auto b = test::make_batch(0);
  RangeStatsCollector collector;
  auto y = net->forward(b.x);
  auto loss = torch::mse_loss(y, b.y);
  loss.backward();
  const auto s = collector.stats();
  clear_module_names();

  // fc2's forward product: its record holds exactly y's values.
  const auto* out = find(s, "net.fc2", "aten::addmm", Direction::kForward);
  ASSERT_NE(out, nullptr) << s.to_json();
  EXPECT_EQ(out->abs_max, y.abs().max().item<float>());
  EXPECT_EQ(out->numel, y.numel());
  // relu ran in the model's own scope; its output is h.
  const auto* relu = find(s, "net", "aten::relu", Direction::kForward);
  ASSERT_NE(relu, nullptr) << s.to_json();
  EXPECT_EQ(relu->zeros, (net->h == 0).sum().item<int64_t>());
  // Gradients: fc1's weight gradient is recorded in backward under fc1.
  const auto g = s.merged("net.fc1", Direction::kBackward);
  EXPECT_GT(g.numel, 0);
  EXPECT_GE(g.abs_max, net->fc1->weight.grad().abs().max().item<float>());
  EXPECT_EQ(s.merged("net.fc1", Direction::kForward).direction, Direction::kForward);
  EXPECT_THAT(s.to_json(), ::testing::HasSubstr("\"scope\": \"net.fc2\""));
}

TEST(RangeStatsTest, DirectionsCanBeLeftOut) {
  Net net;
  RangeStatsCollector collector(RangeStatsOptions().backward(false));
  torch::mse_loss(net->forward(torch::ones({2, 8})), torch::zeros({2, 1})).backward();
  for (const auto& r : collector.stats().records) EXPECT_EQ(r.direction, Direction::kForward);
  EXPECT_FALSE(collector.stats().records.empty());
}

}  // namespace
}  // namespace debug
}  // namespace ampx
