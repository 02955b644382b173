// ampx/fp8/block.h: the block-scaled (MX) formats. The element grids and
// scale rules on values whose answers the formats' definitions give (OCP MX
// 1.0, torchao's nvfp4_reference docstring for E2M1's ties), and, on the
// wheel leg, every format and rule against torchao 0.18's to_mx bit for bit
// (tests/reference/mx_torchao_reference.py), but for the one departure
// ampx/fp8/block.h names: blocks whose scale byte is 0.

#include "ampx/fp8/block.h"
#include "ampx/fp8/cast.h"
#include "ampx/safetensors.h"

#include "../../test_util.h"

#include <torch/torch.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace ampx {
namespace fp8 {
namespace {

using ::testing::HasSubstr;

constexpr ElementFormat kFormats[] = {ElementFormat::kE4M3, ElementFormat::kE5M2,
                                      ElementFormat::kE3M2, ElementFormat::kE2M3,
                                      ElementFormat::kE2M1};
constexpr ScaleRule kRules[] = {ScaleRule::kFloor, ScaleRule::kCeil, ScaleRule::kEven,
                                ScaleRule::kRceil};

TEST(BlockScaledTest, E2M1RoundsTiesToEvenAndSaturates) {
  // value -> the E2M1 value it rounds to (cvt.rn.satfinite.e2m1x2.f32).
  const std::map<float, float> ties = {{0.25f, 0.0f}, {0.75f, 1.0f}, {1.25f, 1.0f},
                                       {1.75f, 2.0f}, {2.5f, 2.0f},  {3.5f, 4.0f},
                                       {5.0f, 4.0f},  {6.5f, 6.0f},  {1e30f, 6.0f}};
  for (const auto& [value, want] : ties) {
    EXPECT_EQ(decode_element(encode_element(value, ElementFormat::kE2M1), ElementFormat::kE2M1),
              want)
        << value;
    EXPECT_EQ(decode_element(encode_element(-value, ElementFormat::kE2M1), ElementFormat::kE2M1),
              -want)
        << -value;
  }
  const std::vector<float> grid = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int code = 0; code < 8; ++code) {
    EXPECT_EQ(decode_element(static_cast<uint8_t>(code), ElementFormat::kE2M1), grid[code]);
  }
  EXPECT_EQ(encode_element(-0.0f, ElementFormat::kE2M1), 0x8) << "-0 keeps its sign";
}

TEST(BlockScaledTest, EveryCodeOfEveryFormatIsItsOwnRounding) {
  for (const ElementFormat f : kFormats) {
    const ElementLimits& l = limits(f);
    for (int code = 0; code < (1 << l.bits); ++code) {
      const float v = decode_element(static_cast<uint8_t>(code), f);
      if (std::isnan(v)) continue;  // E4M3's and E5M2's NaN codes
      if (std::isinf(v)) continue;  // E5M2's inf: the casts saturate
      EXPECT_EQ(encode_element(v, f), code) << to_string(f) << " code " << code << " = " << v;
    }
    EXPECT_EQ(decode_element(l.max_code, f), l.max) << to_string(f);
    EXPECT_EQ(encode_element(l.max * 4, f), l.max_code) << to_string(f) << " saturates";
    EXPECT_EQ(std::ldexp(1.0f, l.max_pow2), std::exp2(std::floor(std::log2(l.max))))
        << to_string(f) << ": emax_elem is the exponent of the largest power of two";
  }
  EXPECT_EQ(limits(ElementFormat::kE3M2).max, 28.0f);
  EXPECT_EQ(limits(ElementFormat::kE2M3).max, 7.5f);
  // E2M3's smallest subnormal, E3M2's: 2^-3 and 2^-4.
  EXPECT_EQ(decode_element(1, ElementFormat::kE2M3), 0.125f);
  EXPECT_EQ(decode_element(1, ElementFormat::kE3M2), 0.0625f);
}

// E4M3 (emax_elem 8, 3 mantissa bits, max 448): the scale's exponent by each
// rule, byte = exponent + 127.
TEST(BlockScaledTest, ScaleRulesOnKnownAmaxes) {
  const auto byte = [](float amax, ScaleRule rule) {
    return static_cast<int>(scale_byte(amax, ElementFormat::kE4M3, rule));
  };
  // 1.0: a power of two; floor(log2) = 0, and 1/448 rounds up to 2^-8.
  for (const ScaleRule r : kRules) EXPECT_EQ(byte(1.0f, r), 127 - 8) << to_string(r);
  // 3.0 = 1.5 x 2: floor 1 - 8; ceil 2 - 8; even keeps 1.5 (3 bits); 3/448 up to 2^-7.
  EXPECT_EQ(byte(3.0f, ScaleRule::kFloor), 127 - 7);
  EXPECT_EQ(byte(3.0f, ScaleRule::kCeil), 127 - 6);
  EXPECT_EQ(byte(3.0f, ScaleRule::kEven), 127 - 7);
  EXPECT_EQ(byte(3.0f, ScaleRule::kRceil), 127 - 7);
  // 1.96875 = 1.1111b: to 3 mantissa bits it is 2.0, so even takes the next binade.
  EXPECT_EQ(byte(1.96875f, ScaleRule::kFloor), 127 - 8);
  EXPECT_EQ(byte(1.96875f, ScaleRule::kEven), 127 - 7);
  // 448 x 2^5 exactly: RCEIL's quotient is 2^5, not raised.
  EXPECT_EQ(byte(448.0f * 32, ScaleRule::kRceil), 127 + 5);
  EXPECT_EQ(byte(448.0f * 32 * 1.0001f, ScaleRule::kRceil), 127 + 6);
  for (const ScaleRule r : kRules) {
    EXPECT_EQ(byte(0.0f, r), 0) << to_string(r) << ": a zero block's scale is 2^-127";
    EXPECT_EQ(byte(NAN, r), 0xFF) << to_string(r);
  }
  // inf: torchao's bit rules read exponent 128; RCEIL writes 0xFE (TE and cuBLAS too).
  EXPECT_EQ(byte(INFINITY, ScaleRule::kFloor), 127 + 128 - 8);
  EXPECT_EQ(byte(INFINITY, ScaleRule::kRceil), 0xFE);
  // The smallest exponent is -127: a subnormal amax takes byte 0 under floor.
  EXPECT_EQ(byte(std::ldexp(1.0f, -140), ScaleRule::kFloor), 0);
  EXPECT_EQ(byte(std::ldexp(1.0f, -140), ScaleRule::kCeil), 0);
}

TEST(BlockScaledTest, ZeroScaleByteIsASubnormalNeverFlushed) {
  EXPECT_EQ(scale_value(0), std::ldexp(1.0f, -127));
  EXPECT_GT(scale_value(0), 0.0f);
  EXPECT_EQ(scale_value(127), 1.0f);
  EXPECT_EQ(scale_value(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(scale_value(255)));
  // amax 2^-125 in E2M1 (emax_elem 2) under floor: exponent -127, byte 0;
  // its elements are x / 2^-127, so 2^-125 is 4 and comes back exactly.
  auto x = torch::zeros({1, 32});
  x[0][0] = std::ldexp(1.0f, -125);
  x[0][1] = -std::ldexp(1.0f, -126);
  const auto mx = BlockTensor::quantize(x, BlockFormat(ElementFormat::kE2M1, ScaleRule::kFloor));
  EXPECT_EQ(mx.scales.item<uint8_t>(), 0);
  EXPECT_EQ(mx.codes[0][0].item<uint8_t>(), 0x6);  // 4.0
  EXPECT_EQ(mx.codes[0][1].item<uint8_t>(), 0xC);  // -2.0
  EXPECT_TRUE(torch::equal(mx.dequantize(), x));
}

TEST(BlockScaledTest, Fp4PacksElementTwoIInTheLowNibble) {
  const auto codes = torch::tensor({1, 2, 3, 4, 0xF, 0x8}, torch::kByte).view({2, 3}).t().contiguous();
  // rows {1, 4}, {2, 0xF}, {3, 0x8}: byte = low | high << 4
  const auto packed = pack_fp4(codes);
  EXPECT_TRUE(torch::equal(packed, torch::tensor({0x41, 0xF2, 0x83}, torch::kByte).view({3, 1})));
  EXPECT_TRUE(torch::equal(unpack_fp4(packed), codes));
}

TEST(BlockScaledTest, ANanBlockIsNanAndOthersAreUntouched) {
  auto x = torch::randn({2, 64});
  x[0][5] = NAN;
  for (const ElementFormat f : kFormats) {
    const auto mx = BlockTensor::quantize(x, BlockFormat(f, ScaleRule::kFloor));
    EXPECT_EQ(mx.scales[0][0].item<uint8_t>(), 0xFF) << to_string(f);
    const auto back = mx.dequantize();
    EXPECT_TRUE(back[0].slice(0, 0, 32).isnan().all().item<bool>()) << to_string(f);
    EXPECT_FALSE(back.slice(1, 32, 64).isnan().any().item<bool>()) << to_string(f);
  }
}

// An element's code keeps the element's own sign in every block (the
// arithmetic the CUDA kernels share, block_math.h): a NaN element's, and an
// element's whose product with its block's factor is NaN (a NaN block's,
// inf times float32 blocks' zero factor), whichever sign the device's NaN
// would have had; a NaN block's float32 scale is the one quiet NaN.
TEST(BlockScaledTest, EveryElementKeepsItsSignWhereTheProductIsNan) {
  auto x = torch::full({1, 32}, -1.0f);
  x[0][1] = NAN;
  x[0][2] = -NAN;
  x[0][3] = 2.0f;
  for (const ElementFormat f : kFormats) {
    SCOPED_TRACE(to_string(f));
    const auto codes = BlockTensor::quantize(x, BlockFormat(f, ScaleRule::kRceil)).codes[0];
    const int sign = 1 << (limits(f).bits - 1);
    const int nan = f == ElementFormat::kE4M3 || f == ElementFormat::kE5M2 ? 0x7F : 0;
    EXPECT_EQ(codes[0].item<uint8_t>(), sign | nan);
    EXPECT_EQ(codes[1].item<uint8_t>(), nan);
    EXPECT_EQ(codes[2].item<uint8_t>(), sign | nan);
    EXPECT_EQ(codes[3].item<uint8_t>(), nan);
  }
  // float32 scales: amax inf gives scale 448 / inf = 0, inf * 0 is NaN.
  auto y = torch::full({1, 4}, -1.0f);
  y[0][0] = INFINITY;
  y[0][1] = -INFINITY;
  const auto t = BlockTensor::quantize(y, BlockFormat::fp8_blockwise());
  EXPECT_TRUE(torch::equal(t.codes[0], torch::tensor({0x7F, 0xFF, 0x80, 0x80}, torch::kByte)));
  const auto nan_block = BlockTensor::quantize(x, BlockFormat::fp8_blockwise());
  EXPECT_EQ(test::to_bits(nan_block.scales.item<float>()), 0x7FC00000u);
}

// block_values decodes every stored scale byte as the scalar decoders do:
// E4M3 bytes (NVFP4) as cast.h's decode, E8M0 bytes as scale_value (the
// arithmetic the CUDA kernel shares, block_math.h).
TEST(BlockScaledTest, BlockValuesDecodeEveryScaleByteAsTheScalarDecoders) {
  const auto bytes = torch::arange(256, torch::kInt).to(torch::kByte).view({256, 1});
  for (const BlockFormat& f : {BlockFormat::nvfp4(), BlockFormat::mxfp4(ScaleRule::kFloor)}) {
    SCOPED_TRACE(f.to_string());
    BlockTensor t;
    t.format = BlockFormat(f).block_cols(2);
    t.codes = torch::full({256, 2}, 2, torch::kByte);  // E2M1 1.0
    t.scales = bytes;
    const auto values = t.block_values();
    for (int b = 0; b < 256; ++b) {
      const float want = f.rule() == ScaleRule::kNvfp4
                             ? decode(static_cast<uint8_t>(b), Fp8Format::kE4M3)
                             : scale_value(static_cast<uint8_t>(b));
      const float got = values[b][1].item<float>();
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << b;
      } else {
        EXPECT_EQ(test::to_bits(got), test::to_bits(want)) << b;
      }
    }
  }
}

TEST(BlockScaledTest, QuantizeAndDequantizeNameWhatIsWrong) {
  const auto error = [](auto fn) { return test::error_text(fn); };
  EXPECT_THAT(error([] {
                (void)BlockTensor::quantize(torch::ones({4, 32}, torch::kDouble),
                                            BlockFormat::mxfp8());
              }),
              HasSubstr("float32, bfloat16 or float16, got Double"));
  EXPECT_THAT(error([] {
                (void)BlockTensor::quantize(torch::ones({32}), BlockFormat::mxfp8().block_cols(0));
              }),
              HasSubstr("block_rows and block_cols must be >= 1, got 1 x 0"));
  EXPECT_THAT(error([] {
                (void)BlockTensor::quantize(torch::ones({2, 32, 32}),
                                            BlockFormat::mxfp8().block_rows(32));
              }),
              HasSubstr("blocks of 32 x 32 take a 2-D tensor, got [2, 32, 32]"));
  EXPECT_THAT(error([] {
                (void)BlockTensor::quantize(torch::ones({32}),
                                            BlockFormat(ElementFormat::kE4M3, ScaleRule::kNvfp4));
              }),
              HasSubstr("the nvfp4 rule takes e2m1 elements, got e4m3"));
  EXPECT_THAT(error([] {
                (void)BlockTensor::quantize(
                    torch::ones({32}), BlockFormat(ElementFormat::kE2M1, ScaleRule::kFloat32));
              }),
              HasSubstr("float32 block scales take e4m3 or e5m2 elements, got e2m1"));
  EXPECT_THAT(error([] { (void)scale_byte(1.0f, ElementFormat::kE4M3, ScaleRule::kNvfp4); }),
              HasSubstr("rule nvfp4 has no E8M0 scale"));
  EXPECT_THAT(error([] { (void)pack_fp4(torch::ones({3}, torch::kByte)); }),
              HasSubstr("even last dimension"));
  const auto mx = BlockTensor::quantize(torch::ones({32}), BlockFormat::mxfp4());
  EXPECT_THAT(error([&] { (void)mx.dequantize(torch::kDouble); }),
              HasSubstr("out_dtype must be float32, bfloat16 or float16, got Double"));
}

// ---- against torchao --------------------------------------------------------

class MxTorchaoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    manifest_ = test::load_reference("mx_torchao.json");
    ASSERT_TRUE(manifest_.is_object()) << "mx_torchao.json is not a JSON object";
    if (manifest_["torchao"].is_null()) {
      GTEST_SKIP() << "no torchao reference on this leg: "
                   << manifest_.value("reason", std::string("(no reason given)"));
    }
    tensors_ = read_safetensors(test::reference_dir() + "/mx_torchao.safetensors");
  }

  const at::Tensor& ref(const std::string& name) const {
    const auto it = tensors_.find(name);
    TORCH_CHECK(it != tensors_.end(), "mx_torchao.safetensors has no tensor '", name,
                "': regenerate it with tests/reference/mx_torchao_reference.py");
    return it->second;
  }

  nlohmann::json manifest_;
  std::map<std::string, at::Tensor> tensors_;
};

// Every input, format and rule: the scale bytes are torchao's; the codes and
// the dequantized values are torchao's in every block whose scale is neither
// NaN (0xFF: torchao leaves FP6/FP4 codes undefined there, and both sides
// dequantize the block to NaN) nor byte 0 (ampx divides by 2^-127, torchao by
// 2^-126 or, under RCEIL, not at all: there ampx's values are the nearer).
TEST_F(MxTorchaoTest, ScalesCodesAndValuesAreTorchaosForEveryFormatAndRule) {
  int64_t compared_blocks = 0, zero_scale_blocks = 0;
  for (const auto& input : manifest_.at("inputs")) {
    const auto x = ref(input.get<std::string>());
    for (const ElementFormat f : kFormats) {
      for (const ScaleRule r : kRules) {
        const std::string key = input.get<std::string>() + "." + to_string(f) + "." + to_string(r);
        SCOPED_TRACE(key);
        const auto mx = BlockTensor::quantize(x, BlockFormat(f, r));
        const auto& want_scales = ref(key + ".scales");
        ASSERT_TRUE(torch::equal(mx.scales, want_scales))
            << "scale bytes differ at "
            << (mx.scales != want_scales).nonzero().slice(0, 0, 3) << ": ampx "
            << mx.scales.masked_select(mx.scales != want_scales).slice(0, 0, 3) << ", torchao "
            << want_scales.masked_select(mx.scales != want_scales).slice(0, 0, 3);
        const auto codes = f == ElementFormat::kE2M1 ? pack_fp4(mx.codes) : mx.codes;
        const auto& want_codes = ref(key + ".codes");
        ASSERT_EQ(codes.sizes(), want_codes.sizes());
        // Blocks compared: scale neither 0xFF nor 0, as elements (x's shape).
        const auto ordinary = mx.scales.ne(0xFF).logical_and(mx.scales.ne(0));
        const int64_t per_block = f == ElementFormat::kE2M1 ? 16 : 32;
        const auto code_mask = ordinary.repeat_interleave(per_block, -1);
        EXPECT_TRUE(torch::equal(codes.masked_select(code_mask), want_codes.masked_select(code_mask)))
            << (codes.ne(want_codes).logical_and(code_mask)).sum().item<int64_t>()
            << " code bytes differ";
        const auto value_mask = ordinary.repeat_interleave(32, -1);
        const auto values = mx.dequantize();
        const auto& want_values = ref(key + ".values");
        EXPECT_TRUE(torch::equal(values.masked_select(value_mask),
                                 want_values.masked_select(value_mask)))
            << "dequantized values differ";
        // NaN blocks: NaN on both sides.
        const auto nan_mask = mx.scales.eq(0xFF).repeat_interleave(32, -1);
        EXPECT_TRUE(values.masked_select(nan_mask).isnan().all().item<bool>());
        EXPECT_TRUE(want_values.masked_select(nan_mask).isnan().all().item<bool>());
        // Byte-0 blocks: ampx's values at least as near to x as torchao's.
        const auto zero_mask = mx.scales.eq(0).repeat_interleave(32, -1);
        const auto xf = x.to(torch::kFloat);
        const auto ampx_error = (values - xf).abs().masked_select(zero_mask);
        const auto torchao_error = (want_values - xf).abs().masked_select(zero_mask);
        EXPECT_TRUE(ampx_error.le(torchao_error).all().item<bool>());
        compared_blocks += ordinary.sum().item<int64_t>();
        zero_scale_blocks += mx.scales.eq(0).sum().item<int64_t>();
      }
    }
  }
  RecordProperty("compared_blocks", static_cast<int>(compared_blocks));
  EXPECT_GT(compared_blocks, 3000);
  EXPECT_GT(zero_scale_blocks, 0) << "the edge input has no block of scale 2^-127";
}

}  // namespace
}  // namespace fp8
}  // namespace ampx
