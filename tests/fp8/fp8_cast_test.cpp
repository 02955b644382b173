// FP8 casts: conformance with PyTorch 2.6's float8 casts (after clamping), and
// properties that need no reference (decoding, round trips, ties, saturation,
// monotonicity), which run on every LibTorch.

#include "ampx/fp8.h"

#include "../test_util.h"

#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <vector>

namespace {

using ampx::fp8::Fp8Format;
using ::testing::HasSubstr;
using ampx::test::from_bits;
using ampx::test::to_bits;

constexpr Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};

// The value of `code` written from the format's definition: sign, exponent
// field E (bias b), mantissa field m of M bits; E = 0 is subnormal.
double formula_value(int code, Fp8Format f) {
  const bool e4m3 = f == Fp8Format::kE4M3;
  const int M = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, all_ones = e4m3 ? 15 : 31;
  const int E = (code & 0x7F) >> M, m = code & ((1 << M) - 1);
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  if (e4m3 && E == all_ones && m == 7) return NAN;  // fn: the only NaN
  if (!e4m3 && E == all_ones) return m == 0 ? sign * INFINITY : NAN;
  if (E == 0) return sign * std::ldexp(m / double(1 << M), 1 - bias);
  return sign * std::ldexp(1.0 + m / double(1 << M), E - bias);
}


std::vector<uint8_t> read_bytes(const std::string& name) {
  const std::string path = ampx::test::reference_dir() + "/" + name;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    ADD_FAILURE() << "reference file " << path
                  << " is missing: run tests/reference/fp8_reference.py generate "
                  << ampx::test::reference_dir();
    return {};
  }
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

torch::Tensor one() {
  return torch::ones({1}, torch::kFloat);
}

// The conformance tests need PyTorch's float8 casts for their reference:
// Python's torch 2.1+, which the 2.x leg has and the 1.13 leg does not.
#define AMPX_SKIP_WITHOUT_TORCH_FLOAT8()                                           \
  if (!AMPX_HAS_TORCH_FLOAT8) {                                                    \
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION                                   \
                 << " and its Python torch have no float8 dtypes to take the "     \
                    "reference from (the 2.x leg checks against PyTorch's casts)"; \
  }

TEST(Fp8CastTest, EveryBf16PatternMatchesTorchsClampedCast) {
  AMPX_SKIP_WITHOUT_TORCH_FLOAT8();
  const auto patterns = torch::arange(65536, torch::kInt).to(torch::kShort).view(torch::kBFloat16);
  for (Fp8Format f : kFormats) {
    const auto expected = read_bytes("fp8_cast_bf16_" + ampx::fp8::to_string(f) + ".bin");
    ASSERT_EQ(expected.size(), 65536u);
    const auto codes = ampx::fp8::quantize(patterns, f, one());
    const uint8_t* got = codes.data_ptr<uint8_t>();
    int mismatches = 0;
    for (int i = 0; i < 65536; ++i) {
      if (got[i] != expected[i] && ++mismatches <= 5) {
        ADD_FAILURE() << ampx::fp8::to_string(f) << ": bf16 0x" << std::hex << i << " gave 0x"
                      << int(got[i]) << ", torch 0x" << int(expected[i]);
      }
    }
    EXPECT_EQ(mismatches, 0) << ampx::fp8::to_string(f);
  }
}

TEST(Fp8CastTest, RandomAndBoundaryFloat32MatchTorchsClampedCast) {
  AMPX_SKIP_WITHOUT_TORCH_FLOAT8();
  const auto raw = read_bytes("fp8_cast_f32_inputs.bin");
  ASSERT_GT(raw.size(), 1000000u);
  const int64_t n = static_cast<int64_t>(raw.size() / 4);
  const auto x = torch::from_blob(const_cast<uint8_t*>(raw.data()), {n}, torch::kFloat).clone();
  for (Fp8Format f : kFormats) {
    const auto expected = read_bytes("fp8_cast_f32_" + ampx::fp8::to_string(f) + ".bin");
    ASSERT_EQ(static_cast<int64_t>(expected.size()), n);
    const auto codes = ampx::fp8::quantize(x, f, one());
    const uint8_t* got = codes.data_ptr<uint8_t>();
    const float* in = x.data_ptr<float>();
    int64_t mismatches = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (got[i] != expected[i] && ++mismatches <= 5) {
        ADD_FAILURE() << ampx::fp8::to_string(f) << ": " << in[i] << " (0x" << std::hex
                      << to_bits(in[i]) << ") gave 0x" << int(got[i]) << ", torch 0x"
                      << int(expected[i]);
      }
    }
    EXPECT_EQ(mismatches, 0) << ampx::fp8::to_string(f) << " over " << n << " values";
  }
}

TEST(Fp8CastTest, TorchFloat8ViewsAreBitCastsOfTheCodes) {
  AMPX_SKIP_WITHOUT_TORCH_FLOAT8();
#if AMPX_HAS_TORCH_FLOAT8
  const auto codes = torch::arange(256, torch::kInt).to(torch::kByte);
  for (Fp8Format f : kFormats) {
    const auto as_torch = ampx::fp8::codes_to_torch_float8(codes, f);
    EXPECT_EQ(as_torch.scalar_type(), ampx::fp8::torch_dtype(f));
    EXPECT_EQ(as_torch.data_ptr(), codes.data_ptr());  // a view
    EXPECT_TRUE(ampx::fp8::torch_float8_to_codes(as_torch).equal(codes));
    // Torch reads each code as the value our decoder gives.
    const auto values = as_torch.to(torch::kFloat);
    const auto ours = ampx::fp8::dequantize(codes, f, one());
    EXPECT_TRUE(values.isnan().equal(ours.isnan()));
    EXPECT_TRUE(values.nan_to_num(0).equal(ours.nan_to_num(0))) << ampx::fp8::to_string(f);
  }
  EXPECT_THAT(ampx::test::error_text([&] { (void)ampx::fp8::torch_float8_to_codes(one()); }),
              HasSubstr("ampx::fp8::torch_float8_to_codes: x must be float8_e4m3fn or "
                        "float8_e5m2, got Float"));
#endif
}

TEST(Fp8CastTest, EveryCodeDecodesToTheFormatsDefinition) {
  for (Fp8Format f : kFormats) {
    const auto codes = torch::arange(256, torch::kInt).to(torch::kByte);
    const auto values = ampx::fp8::dequantize(codes, f, one());
    for (int c = 0; c < 256; ++c) {
      const double want = formula_value(c, f);
      const float got = values[c].item<float>();
      EXPECT_EQ(to_bits(ampx::fp8::decode(static_cast<uint8_t>(c), f)), to_bits(got));
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << ampx::fp8::to_string(f) << " code " << c;
      } else {
        EXPECT_EQ(static_cast<double>(got), want) << ampx::fp8::to_string(f) << " code " << c;
        EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;  // -0 stays -0
      }
    }
    const auto& lim = ampx::fp8::limits(f);
    EXPECT_EQ(formula_value(lim.max_code, f), lim.max);
    EXPECT_EQ(formula_value(1, f), lim.min_subnormal);
    EXPECT_EQ(formula_value(1 << lim.mantissa_bits, f), lim.min_normal);
  }
  EXPECT_EQ(ampx::fp8::limits(Fp8Format::kE4M3).max, 448.0f);
  EXPECT_EQ(ampx::fp8::limits(Fp8Format::kE5M2).max, 57344.0f);
}

TEST(Fp8CastTest, CodeToValueToCodeIsTheIdentity) {
  for (Fp8Format f : kFormats) {
    const auto codes = torch::arange(256, torch::kInt).to(torch::kByte);
    const auto values = ampx::fp8::dequantize(codes, f, one());
    const auto back = ampx::fp8::quantize(values, f, one());
    for (int c = 0; c < 256; ++c) {
      const double v = formula_value(c, f);
      if (std::isnan(v) || std::isinf(v)) continue;  // inf saturates: SaturatesAndKeepsNaN
      EXPECT_EQ(back[c].item<int>(), c) << ampx::fp8::to_string(f);
      // bf16 and fp16 hold every FP8 value exactly: the same through them.
      for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
        EXPECT_EQ(ampx::fp8::quantize(values[c].to(dtype), f, one()).item<int>(), c);
      }
    }
  }
}

TEST(Fp8CastTest, TiesGoToTheEvenCodeAndEverythingElseToTheNearest) {
  for (Fp8Format f : kFormats) {
    const auto& lim = ampx::fp8::limits(f);
    for (int c = 0; c < lim.max_code; ++c) {  // c and c + 1 are neighbours
      for (uint8_t sign : {0x00, 0x80}) {
        const float lo = static_cast<float>(formula_value(c | sign, f));
        const float hi = static_cast<float>(formula_value((c + 1) | sign, f));
        const float mid = (lo + hi) / 2;  // exact in float32
        const int even = (c % 2 == 0) ? c : c + 1;
        EXPECT_EQ(ampx::fp8::encode(mid, f), even | sign)
            << ampx::fp8::to_string(f) << " between codes " << c << " and " << c + 1;
        // One float32 ulp towards either side leaves the tie.
        const float toward_lo = std::nextafter(mid, lo), toward_hi = std::nextafter(mid, hi);
        EXPECT_EQ(ampx::fp8::encode(toward_lo, f), c | sign) << c;
        EXPECT_EQ(ampx::fp8::encode(toward_hi, f), (c + 1) | sign) << c;
      }
    }
  }
}

TEST(Fp8CastTest, SaturatesToMaxAndKeepsNaN) {
  for (Fp8Format f : kFormats) {
    const auto& lim = ampx::fp8::limits(f);
    const uint8_t max = lim.max_code, neg_max = static_cast<uint8_t>(lim.max_code | 0x80);
    for (float big : {lim.max, std::nextafter(lim.max, INFINITY), lim.max * 1.0625f, lim.max * 2,
                      3e38f, INFINITY}) {
      EXPECT_EQ(ampx::fp8::encode(big, f), max) << ampx::fp8::to_string(f) << " " << big;
      EXPECT_EQ(ampx::fp8::encode(-big, f), neg_max) << ampx::fp8::to_string(f) << " " << -big;
    }
    EXPECT_EQ(ampx::fp8::encode(NAN, f), 0x7F);
    EXPECT_EQ(ampx::fp8::encode(-NAN, f), 0xFF);
    // Through a scale too: 1000 * 1 and 1 * 1000 both saturate.
    const auto x = torch::tensor({1000.0f, 1.0f, -INFINITY, NAN});
    const auto codes = ampx::fp8::quantize(x, f, torch::full({1}, 1000.0f));
    EXPECT_EQ(codes[0].item<int>(), max);
    EXPECT_EQ(codes[1].item<int>(), f == Fp8Format::kE4M3 ? max : ampx::fp8::encode(1000.0f, f));
    EXPECT_EQ(codes[2].item<int>(), neg_max);
    EXPECT_EQ(codes[3].item<int>(), 0x7F);
    // Below half the smallest subnormal: zero, signed.
    EXPECT_EQ(ampx::fp8::encode(lim.min_subnormal / 2, f), 0x00);
    EXPECT_EQ(ampx::fp8::encode(-lim.min_subnormal / 2, f), 0x80);
    EXPECT_EQ(ampx::fp8::encode(std::nextafter(lim.min_subnormal / 2, 1.0f), f), 0x01);
  }
}

TEST(Fp8CastTest, IsMonotonic) {
  std::mt19937 gen(14);
  std::uniform_int_distribution<uint32_t> any;
  std::vector<float> xs;
  for (int i = 0; i < 200000; ++i) {
    const float v = from_bits(any(gen));
    if (!std::isnan(v)) xs.push_back(v);
  }
  std::uniform_real_distribution<float> near(-70000.0f, 70000.0f), small(-1.0f, 1.0f);
  for (int i = 0; i < 100000; ++i) xs.push_back(near(gen));
  for (int i = 0; i < 100000; ++i) xs.push_back(small(gen) * small(gen) * small(gen));
  std::sort(xs.begin(), xs.end());
  const auto x = torch::from_blob(xs.data(), {static_cast<int64_t>(xs.size())}, torch::kFloat);
  for (Fp8Format f : kFormats) {
    const auto rounded = ampx::fp8::round_to_fp8(x, f);
    const auto diffs = rounded.slice(0, 1) - rounded.slice(0, 0, -1);
    EXPECT_EQ(diffs.lt(0).sum().item<int64_t>(), 0) << ampx::fp8::to_string(f);
    EXPECT_EQ(rounded.isnan().sum().item<int64_t>(), 0);
  }
}

TEST(Fp8CastTest, ScaleMultipliesInFloat32BeforeTheCast) {
  const auto x = torch::randn({4096}, torch::TensorOptions().dtype(torch::kFloat)) * 3;
  const auto scale = torch::full({1}, 37.5f);
  for (Fp8Format f : kFormats) {
    const auto codes = ampx::fp8::quantize(x, f, scale);
    EXPECT_TRUE(codes.equal(ampx::fp8::quantize(x * scale, f, one())));
    const auto scale_inv = torch::ones({1}) / scale;
    const auto back = ampx::fp8::dequantize(codes, f, scale_inv, torch::kBFloat16);
    EXPECT_EQ(back.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(
        back.equal((ampx::fp8::dequantize(codes, f, one()) * scale_inv).to(torch::kBFloat16)));
  }
}

TEST(Fp8CastTest, Fp8TensorHoldsTheCodesTheirScaleInvAndFormat) {
  const auto x = torch::tensor({1.0f, 300.0f, 1000.0f, -0.0f, 0.01f});
  const auto scale = torch::full({1}, 0.5f);
  const auto t = ampx::fp8::Fp8Tensor::quantize(x, Fp8Format::kE5M2, scale);
  EXPECT_EQ(t.format, Fp8Format::kE5M2);
  EXPECT_TRUE(torch::equal(t.codes, ampx::fp8::quantize(x, Fp8Format::kE5M2, scale)));
  EXPECT_EQ(t.scale_inv.item<float>(), 2.0f);
  EXPECT_TRUE(torch::equal(
      t.dequantize(torch::kBFloat16),
      ampx::fp8::dequantize(t.codes, Fp8Format::kE5M2, t.scale_inv, torch::kBFloat16)));
}

TEST(Fp8CastTest, RoundToFp8KeepsTheDtypeAndWidensBf16AndFp16Exactly) {
  const auto x = torch::randn({3, 5, 7}) * 100;
  for (Fp8Format f : kFormats) {
    for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
      const auto xd = x.to(dtype);
      const auto r = ampx::fp8::round_to_fp8(xd, f);
      EXPECT_EQ(r.scalar_type(), dtype);
      EXPECT_EQ(r.sizes(), xd.sizes());
      EXPECT_TRUE(ampx::fp8::quantize(xd, f, one())
                      .equal(ampx::fp8::quantize(xd.to(torch::kFloat), f, one())));
      EXPECT_TRUE(r.to(torch::kFloat).equal(ampx::fp8::round_to_fp8(xd.to(torch::kFloat), f)));
    }
  }
  // Non-contiguous input keeps its shape.
  const auto t = x.transpose(0, 2);
  EXPECT_TRUE(ampx::fp8::round_to_fp8(t, Fp8Format::kE4M3)
                  .equal(ampx::fp8::round_to_fp8(t.contiguous(), Fp8Format::kE4M3)));
}

TEST(Fp8CastTest, RejectsWhatItCannotCast) {
  EXPECT_THAT(ampx::test::error_text([] {
                (void)ampx::fp8::quantize(torch::ones({2}, torch::kDouble), Fp8Format::kE4M3,
                                          one());
              }),
              HasSubstr("ampx::fp8::quantize: x must be float32, bfloat16 or float16, got Double"));
  EXPECT_THAT(ampx::test::error_text([] {
                (void)ampx::fp8::quantize(torch::ones({2}), Fp8Format::kE4M3, torch::ones({2}));
              }),
              HasSubstr("ampx::fp8::quantize: scale must be a float32 tensor of one element, got "
                        "Float with 2 elements"));
  EXPECT_THAT(ampx::test::error_text(
                  [] { (void)ampx::fp8::dequantize(torch::ones({2}), Fp8Format::kE4M3, one()); }),
              HasSubstr("ampx::fp8::dequantize: codes must be uint8, got Float"));
}

TEST(Fp8CastTest, CudaMatchesTheCpuKernel) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
  const auto x = torch::randn({1 << 16}) * 500;
  const auto scale = torch::full({1}, 0.75f);
  for (Fp8Format f : kFormats) {
    const auto cpu = ampx::fp8::quantize(x, f, scale);
    const auto cuda = ampx::fp8::quantize(x.cuda(), f, scale.cuda());
    EXPECT_TRUE(cuda.is_cuda());
    EXPECT_TRUE(cuda.cpu().equal(cpu)) << ampx::fp8::to_string(f);
    const auto back = ampx::fp8::dequantize(cuda, f, scale.cuda(), torch::kBFloat16);
    EXPECT_TRUE(back.cpu().equal(ampx::fp8::dequantize(cpu, f, scale, torch::kBFloat16)));
  }
}

}  // namespace
