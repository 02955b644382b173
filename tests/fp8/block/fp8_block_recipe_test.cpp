// The block-scaled formats beyond torchao's MX casts (ampx/fp8/block.h) and
// the block-scaled recipes of an FP8 layer (ampx/fp8/block_recipe.h):
// NVFP4 as Transformer Engine computes it, FP8 blockwise scales, 2-D blocks,
// stochastic rounding, the Hadamard transform; on the legs whose Python has
// float8 dtypes, every code and scale against tests/reference/
// block_reference.py, written from the published formulas (the layer under
// each recipe: fp8_block_linear_test.cpp).

#include "ampx/fp8/block.h"
#include "ampx/fp8/linear.h"
#include "ampx/safetensors.h"

#include "../../test_util.h"

#include <torch/torch.h>

#include <cfloat>
#include <cmath>
#include <map>
#include <sstream>
#include <string>

namespace ampx {
namespace fp8 {
namespace {

using ::testing::HasSubstr;

// ---- the formats on values their definitions give ------------------------------

// quantize's vectorised element loop against encode_element, the one
// scalar rounding, on random float32 bit patterns of every binade, ties
// among them, in blocks of scale 1 (the first element 2^emax_elem).
TEST(BlockFormatTest, QuantizeRoundsEveryElementAsEncodeElement) {
  torch::manual_seed(8);
  const int64_t n = 1 << 18;
  for (const ElementFormat f : {ElementFormat::kE4M3, ElementFormat::kE5M2, ElementFormat::kE3M2,
                                ElementFormat::kE2M3, ElementFormat::kE2M1}) {
    SCOPED_TRACE(to_string(f));
    const ElementLimits& l = limits(f);
    auto bits = torch::randint(0, int64_t{1} << 31, {n}, torch::kLong);
    auto x = bits.to(torch::kInt).view(torch::kFloat).clone();
    // Ties: codes' midpoints, below and above.
    for (int64_t code = 0; code + 1 < (1 << (l.bits - 1)) && code + 1 <= l.max_code; ++code) {
      const float mid = 0.5f * (decode_element(code, f) + decode_element(code + 1, f));
      x[code * 3] = mid;
      x[code * 3 + 1] = std::nextafter(mid, 0.0f);
      x[code * 3 + 2] = -std::nextafter(mid, 100.0f);
    }
    const float top = std::min(l.max * 1.1f, std::ldexp(1.99f, l.max_pow2));  // scale stays 1
    x = x.clamp(-top, top);  // saturation too, and no inf or NaN
    x = torch::where(x.isnan(), torch::zeros_like(x), x);
    x.view({-1, 64}).select(1, 0).fill_(std::ldexp(1.0f, l.max_pow2));
    const auto t = BlockTensor::quantize(x.view({-1, 64}), BlockFormat(f, ScaleRule::kFloor).block_cols(64));
    ASSERT_TRUE(t.scales.eq(127).all().item<bool>());
    const auto* xs = x.data_ptr<float>();
    const auto codes = t.codes.reshape({-1});
    const auto* cs = codes.data_ptr<uint8_t>();
    int64_t differ = 0;
    for (int64_t i = 0; i < n; ++i) differ += cs[i] != encode_element(xs[i], f);
    EXPECT_EQ(differ, 0);
  }
}

TEST(BlockFormatTest, Nvfp4ScalesFollowTransformerEnginesFormula) {
  // Global amax 6: S_enc = 2688 / 6 = 448; the first block's amax 6 gives
  // e4m3(6 * 448 / 6) = 448, encode 1: its elements are their own codes.
  auto x = torch::zeros({1, 32});
  x[0].slice(0, 0, 8) = torch::tensor({0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f});
  x[0][16] = 0.75f;  // second block: amax 0.75, scale e4m3(0.75 * 74.67) = e4m3(56) = 56
  const auto t = BlockTensor::quantize(x, BlockFormat::nvfp4());
  ASSERT_EQ(t.scales.sizes(), (c10::IntArrayRef{1, 2}));
  EXPECT_EQ(t.global_amax, 6.0f);
  EXPECT_EQ(decode(t.scales[0][0].item<uint8_t>(), Fp8Format::kE4M3), 448.0f);
  EXPECT_EQ(decode(t.scales[0][1].item<uint8_t>(), Fp8Format::kE4M3), 56.0f);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(t.codes[0][i].item<uint8_t>(), i) << i;
  // 0.75 * 1 / (56 / 448) = 6: the block's amax maps to E2M1's largest.
  EXPECT_EQ(t.codes[0][16].item<uint8_t>(), 0x7);
  // The block values are exact; the tensor scale 6 / 2688 is not (2688 = 2^7 21).
  EXPECT_TRUE(torch::equal(t.block_values(), x * (2688.0f / 6.0f)));
  EXPECT_TRUE(torch::allclose(t.dequantize(), x, /*rtol=*/3e-7, /*atol=*/0));
  EXPECT_EQ(nvfp4_encode_scale(0.0f), 1.0f);
  EXPECT_EQ(nvfp4_encode_scale(6.0f), 448.0f);
}

TEST(BlockFormatTest, Nvfp4UnderflowingBlockScaleIsZeroAndItsElementsSaturate) {
  // A block far below the tensor's amax: its E4M3 scale rounds to 0 (no lower
  // clamp), the encode factor is FLT_MAX, and its nonzero elements become +-6
  // (TE's arithmetic; they dequantize to zero).
  auto x = torch::zeros({1, 32});
  x[0][0] = 1000.0f;
  x[0][16] = 1e-6f;
  x[0][17] = -1e-7f;
  const auto t = BlockTensor::quantize(x, BlockFormat::nvfp4());
  EXPECT_EQ(t.scales[0][1].item<uint8_t>(), 0);
  EXPECT_EQ(t.codes[0][16].item<uint8_t>(), 0x7);
  EXPECT_EQ(t.codes[0][17].item<uint8_t>(), 0xF);
  EXPECT_EQ(t.codes[0][18].item<uint8_t>(), 0x0);
  EXPECT_EQ(t.dequantize()[0][16].item<float>(), 0.0f);
}

TEST(BlockFormatTest, Float8BlockwiseScalesArePowersOfTwoBelow448OverAmax) {
  auto x = torch::zeros({2, 256});
  x[0][0] = 3.0f;   // 448 / 3 = 149.3: down to 128
  x[0][128] = 0.0f; // a zero block: scale 1
  x[1][0] = 448.0f; // scale 1 exactly
  const auto t = BlockTensor::quantize(x, BlockFormat::fp8_blockwise());
  ASSERT_EQ(t.scales.scalar_type(), torch::kFloat);
  ASSERT_EQ(t.scales.sizes(), (c10::IntArrayRef{2, 2}));
  EXPECT_EQ(t.scales[0][0].item<float>(), 1.0f / 128);
  EXPECT_EQ(t.scales[0][1].item<float>(), 1.0f);
  EXPECT_EQ(t.scales[1][0].item<float>(), 1.0f);
  EXPECT_EQ(decode(t.codes[0][0].item<uint8_t>(), Fp8Format::kE4M3), 384.0f);
  const auto plain = BlockTensor::quantize(
      x, BlockFormat(ElementFormat::kE4M3, ScaleRule::kFloat32).block_cols(128));
  EXPECT_EQ(plain.scales[0][0].item<float>(), 1.0f / (448.0f / 3.0f));
  EXPECT_EQ(decode(plain.codes[0][0].item<uint8_t>(), Fp8Format::kE4M3), 448.0f);
  EXPECT_TRUE(torch::equal(t.dequantize(), x));
}

TEST(BlockFormatTest, TwoDimensionalBlocksTransposeWithoutRequantizing) {
  torch::manual_seed(1);
  const auto x = torch::randn({64, 96}) * torch::exp2(torch::randint(-8, 8, {64, 1}).to(torch::kFloat));
  for (const BlockFormat& f : {BlockFormat::mxfp8().block_rows(32).block_cols(32),
                               BlockFormat::nvfp4().block_rows(16),
                               BlockFormat::fp8_blockwise().block_rows(32).block_cols(32)}) {
    SCOPED_TRACE(f.to_string());
    const auto t = BlockTensor::quantize(x, f);
    EXPECT_EQ(t.scales.size(0), 64 / f.block_rows());
    const auto tt = t.transposed();
    const auto direct = BlockTensor::quantize(x.t().contiguous(), BlockFormat(f).block_rows(f.block_cols()).block_cols(f.block_rows()));
    EXPECT_TRUE(torch::equal(tt.codes, direct.codes));
    EXPECT_TRUE(torch::equal(tt.scales, direct.scales));
    EXPECT_TRUE(torch::equal(tt.dequantize(), t.dequantize().t()));
  }
  EXPECT_THAT(test::error_text([&] { (void)BlockTensor::quantize(x, BlockFormat::nvfp4()).transposed(); }),
              HasSubstr("takes a 2-D tensor in 2-D blocks"));
}

// Blocks down the columns (32 x 1: TE's column-wise copy, in place) are the
// row blocks of the transpose, transposed; stochastic rounding included.
TEST(BlockFormatTest, ColumnBlocksAreTheTransposesRowBlocks) {
  torch::manual_seed(9);
  const auto x = torch::randn({96, 48}) * torch::exp2(torch::randint(-6, 6, {1, 48}).to(torch::kFloat));
  for (const BlockFormat& f : {BlockFormat::mxfp8(), BlockFormat::nvfp4(),
                               BlockFormat::fp8_blockwise().block_cols(32)}) {
    SCOPED_TRACE(f.to_string());
    const auto columns = BlockTensor::quantize(x, BlockFormat(f).block_rows(f.block_cols()).block_cols(1));
    const auto rows = BlockTensor::quantize(x.t().contiguous(), f);
    EXPECT_TRUE(torch::equal(columns.codes, rows.codes.t()));
    EXPECT_TRUE(torch::equal(columns.scales, rows.scales.t()));
    EXPECT_TRUE(torch::equal(columns.dequantize(), rows.dequantize().t()));
  }
  // Stochastic: the same numbers by element index, so the same codes as a
  // row-block quantization of the same tensor in its own layout.
  const auto f = BlockFormat::nvfp4();
  const auto a = BlockTensor::quantize(x, BlockFormat(f).block_rows(16).block_cols(1), StochasticRounding{3, 5});
  const auto b = BlockTensor::quantize(x, BlockFormat(f).block_rows(16).block_cols(1), StochasticRounding{3, 5});
  EXPECT_TRUE(torch::equal(a.codes, b.codes));
  EXPECT_FALSE(torch::equal(a.codes, BlockTensor::quantize(x, BlockFormat(f).block_rows(16).block_cols(1)).codes));
}

TEST(BlockFormatTest, BlocksThatDoNotDivideAreCutShort) {
  auto x = torch::ones({3, 40});
  x.slice(1, 32, 40) *= 0.25f;  // the short block's own amax
  const auto t = BlockTensor::quantize(x, BlockFormat::mxfp8());
  ASSERT_EQ(t.scales.sizes(), (c10::IntArrayRef{3, 2}));
  EXPECT_EQ(scale_value(t.scales[0][1].item<uint8_t>()), std::ldexp(1.0f, -10));  // 0.25/448 up
  EXPECT_TRUE(torch::equal(t.dequantize(), x));
}

TEST(BlockFormatTest, StochasticRoundingIsUnbiasedAndDeterministicForASeed) {
  // 2.3 lies between E2M1's 2 and 3: up with probability 0.3. Over n draws
  // the mean is 2.3 within 5 standard deviations (sqrt(0.21 / n)).
  const int64_t n = 1 << 16;
  auto x = torch::full({1, n}, 2.3f);
  x[0][0] = 6.0f;  // the block's amax: scale 2^(2 - 2) = 1 under floor
  const auto f = BlockFormat(ElementFormat::kE2M1, ScaleRule::kFloor).block_cols(n);
  const auto t = BlockTensor::quantize(x, f, StochasticRounding{7, 0});
  ASSERT_EQ(scale_value(t.scales.item<uint8_t>()), 1.0f);
  const auto values = t.dequantize().slice(1, 1, n);
  EXPECT_TRUE(values.eq(2.0f).logical_or(values.eq(3.0f)).all().item<bool>());
  const double mean = values.mean().item<double>();
  EXPECT_NEAR(mean, 2.3, 5 * std::sqrt(0.21 / n));
  // Nearest rounding is biased there: always 2.
  EXPECT_EQ(BlockTensor::quantize(x, f).dequantize().slice(1, 1, n).mean().item<double>(), 2.0);
  // The same seed, the same codes, on one thread or two; another seed, others.
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);
  const auto one = BlockTensor::quantize(x, f, StochasticRounding{7, 0});
  torch::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(one.codes, t.codes));
  EXPECT_FALSE(torch::equal(BlockTensor::quantize(x, f, StochasticRounding{8, 0}).codes, t.codes));
  // An offset moves along the same stream.
  const auto shifted = BlockTensor::quantize(x.slice(1, 0, 1024), BlockFormat(f).block_cols(1024),
                                             StochasticRounding{7, 1024});
  EXPECT_TRUE(torch::equal(shifted.codes[0].slice(0, 1), t.codes[0].slice(0, 1025, 2048)));
  // Exact values stay, saturation holds.
  EXPECT_EQ(encode_element_stochastic(3.0f, ElementFormat::kE2M1, 0xFFFFFFFFu), 0x5);
  EXPECT_EQ(encode_element_stochastic(-7.0f, ElementFormat::kE2M1, 0u), 0xF);
  EXPECT_EQ(encode_element_stochastic(6.0f, ElementFormat::kE2M1, 0u), 0x7);
  EXPECT_EQ(encode_element_stochastic(INFINITY, ElementFormat::kE2M1, 0u), 0x7);
  EXPECT_EQ(encode_element_stochastic(-NAN, ElementFormat::kE2M1, 0u), 0x8);
  EXPECT_EQ(encode_element_stochastic(NAN, ElementFormat::kE4M3, 0u), 0x7F);
  EXPECT_EQ(encode_element_stochastic(500.0f, ElementFormat::kE4M3, 0u), 0x7E);
  // Subnormals: E4M3's 2^-9 quanta; 1.25 quanta goes up one time in four.
  int ups = 0;
  for (uint32_t r = 0; r < 4096; ++r) {
    ups += encode_element_stochastic(std::ldexp(1.25f, -9), ElementFormat::kE4M3, r << 20) == 2;
  }
  EXPECT_EQ(ups, 1024);
  EXPECT_EQ(encode_element_stochastic(2.5f, ElementFormat::kE4M3, 0u), 0x42);
}

// Element (r, c) of a 2-D tensor draws number offset + r * cols + c of the
// stream (block.h: element i of the tensor, row-major), whatever its
// blocks: each row rounds as the one-row tensor that starts there in the
// stream. Every block (1 x 16, 16 x 16, 16 x 1) holds one element of
// magnitude 6, its amax: the scales are the one-row tensors' (NVFP4's S_enc
// too), and the others fall between codes.
TEST(BlockFormatTest, StochasticRoundingDrawsElementRTimesColsPlusCOfTheStream) {
  torch::manual_seed(10);
  const int64_t rows = 48, cols = 64;
  const auto r = torch::arange(rows).unsqueeze(1), c = torch::arange(cols).unsqueeze(0);
  const auto x = torch::where((r + c) % 16 == 0, torch::full({rows, cols}, 6.0f),
                              torch::rand({rows, cols}) * 11.0f - 5.5f);
  const StochasticRounding stream{11, 1000};
  const auto nvfp4 = BlockFormat::nvfp4();
  const auto fp8 = BlockFormat::fp8_blockwise().block_cols(16);
  for (const BlockFormat& f :
       {nvfp4, BlockFormat(nvfp4).block_rows(16), BlockFormat(nvfp4).block_rows(16).block_cols(1),
        fp8, BlockFormat(fp8).block_rows(16)}) {
    SCOPED_TRACE(f.to_string());
    const auto t = BlockTensor::quantize(x, f, stream);
    const auto one_row = BlockFormat(f).block_rows(1).block_cols(16);
    for (int64_t i = 0; i < rows; ++i) {
      const auto row = BlockTensor::quantize(
          x.slice(0, i, i + 1), one_row,
          StochasticRounding{stream.seed, stream.offset + static_cast<uint64_t>(i * cols)});
      ASSERT_TRUE(torch::equal(t.codes.slice(0, i, i + 1), row.codes)) << "row " << i;
    }
  }
  // Rows alike, codes not: each row draws its own numbers.
  const auto alike = x.slice(0, 0, 1).expand({16, cols}).contiguous();
  const auto t = BlockTensor::quantize(alike, BlockFormat(nvfp4).block_rows(16), stream);
  for (int64_t i = 1; i < 16; ++i) {
    EXPECT_FALSE(torch::equal(t.codes[i], t.codes[0])) << "row " << i;
  }
}

TEST(BlockFormatTest, Hadamard16IsOrthogonalAndKeepsProducts) {
  const auto eye = torch::eye(16);
  const auto h = hadamard16(eye);
  EXPECT_TRUE(torch::equal(h.mm(h.t()), eye)) << "entries +-1/4: H H^T is exact";
  EXPECT_TRUE(torch::equal(hadamard16(eye, /*inverse=*/true), h.t()));
  torch::manual_seed(2);
  const auto x = torch::randn({8, 64}), g = torch::randn({4, 64});
  // Forward and back: within 2^-20 of x's largest element (16-term sums, twice).
  const auto back = hadamard16(hadamard16(x), true);
  EXPECT_LE((back - x).abs().max().item<float>(), std::ldexp(1.0f, -20) * x.abs().max().item<float>());
  // Down the columns: each column's tiles as the rows' are.
  // The same butterflies, bit for bit (eight columns at a time, then one by one).
  const auto xt = torch::randn({64, 21});
  for (const bool inverse : {false, true}) {
    EXPECT_TRUE(torch::equal(hadamard16(xt, inverse, 0), hadamard16(xt.t().contiguous(), inverse).t()));
  }
  EXPECT_THAT(test::error_text([&] { (void)hadamard16(torch::randn({20, 16}), false, 0); }),
              HasSubstr("dimension 0 must be a multiple of 16, got [20, 16]"));
  const auto product = g.mm(x.t());
  const auto transformed = hadamard16(g).mm(hadamard16(x).t());
  EXPECT_TRUE(torch::allclose(transformed, product, 1e-5, 1e-5));
}

TEST(BlockFormatTest, RecipesNameWhatIsWrong) {
  EXPECT_THAT(test::error_text([] { MXFP8BlockScaling().fp8_format(RecipeFormat::kE5M2).validate(); }),
              HasSubstr("E5M2 in both passes is refused"));
  EXPECT_THAT(test::error_text([] { MXFP8BlockScaling().scale_rule(ScaleRule::kNvfp4).validate(); }),
              HasSubstr("scale_rule nvfp4 has no E8M0 scale"));
  EXPECT_THAT(test::error_text([] { Float8BlockScaling().block(0).validate(); }),
              HasSubstr("block must be >= 1, got 0"));
  EXPECT_THAT(test::error_text([] { (void)Recipe(NVFP4BlockScaling()).fp8_format(); }),
              HasSubstr("has no FP8 format"));
  EXPECT_THAT(test::error_text([] { (void)TensorScaling(Recipe(MXFP8BlockScaling()), Direction::kForward, torch::kCPU); }),
              HasSubstr("scales blocks, not whole tensors"));
  Linear fc(LinearOptions(32, 32).recipe(NVFP4BlockScaling()));
  EXPECT_THAT(test::error_text([&] { (void)fc->input_state(); }),
              HasSubstr("has no delayed-scaling states"));
  EXPECT_EQ(Recipe(MXFP8BlockScaling()).to_string(), "mxfp8(e4m3, rceil)");
  EXPECT_EQ(Recipe(NVFP4BlockScaling()).to_string(),
            "nvfp4(16x16 weights, stochastic gradients, hadamard, seed 0)");
  EXPECT_EQ(Recipe(Float8BlockScaling()).to_string(),
            "fp8-block(1x128, 128x128 weights, power-of-2 scales)");
}

// ---- against the formulas' Python reference ----------------------------------------

class BlockReferenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    manifest_ = test::load_reference("block_reference.json");
    ASSERT_TRUE(manifest_.is_object()) << "block_reference.json is not a JSON object";
    if (manifest_["torch"].is_null()) {
      GTEST_SKIP() << "no block reference on this leg: "
                   << manifest_.value("reason", std::string("(no reason given)"));
    }
    tensors_ = read_safetensors(test::reference_dir() + "/block_reference.safetensors");
  }
  const at::Tensor& ref(const std::string& name) const {
    const auto it = tensors_.find(name);
    TORCH_CHECK(it != tensors_.end(), "block_reference.safetensors has no tensor '", name,
                "': regenerate it with tests/reference/block_reference.py");
    return it->second;
  }
  nlohmann::json manifest_;
  std::map<std::string, at::Tensor> tensors_;
};

TEST_F(BlockReferenceTest, CodesAndScalesAreTheFormulasBitForBit) {
  const std::map<std::string, BlockFormat> cases = {
      {"nvfp4_1x16", BlockFormat::nvfp4()},
      {"nvfp4_16x16", BlockFormat::nvfp4().block_rows(16)},
      {"fp8block_1x128_pow2", BlockFormat::fp8_blockwise()},
      {"fp8block_1x128", BlockFormat(ElementFormat::kE4M3, ScaleRule::kFloat32).block_cols(128)},
      {"fp8block_128x128_pow2", BlockFormat::fp8_blockwise().block_rows(128)},
      {"mxfp8_32x32_rceil", BlockFormat::mxfp8().block_rows(32)},
  };
  int64_t compared = 0;
  for (const auto& input : manifest_.at("inputs")) {
    const auto& x = ref(input.get<std::string>());
    for (const auto& [name, format] : cases) {
      const std::string key = input.get<std::string>() + "." + name;
      SCOPED_TRACE(key);
      const auto t = BlockTensor::quantize(x, format);
      const auto& want_scales = ref(key + ".scales");
      ASSERT_EQ(t.scales.sizes(), want_scales.sizes());
      EXPECT_TRUE(torch::equal(t.scales, want_scales))
          << t.scales.ne(want_scales).sum().item<int64_t>() << " scales differ";
      const auto& want_codes = ref(key + ".codes");
      EXPECT_TRUE(torch::equal(t.codes, want_codes))
          << t.codes.ne(want_codes).sum().item<int64_t>() << " codes differ, first at "
          << t.codes.ne(want_codes).nonzero().slice(0, 0, 1);
      if (format.rule() == ScaleRule::kNvfp4) {
        EXPECT_EQ(t.global_amax, ref(key + ".global_amax").item<float>());
      }
      compared += t.codes.numel();
    }
    const auto& want_h = ref(input.get<std::string>() + ".hadamard16.values");
    EXPECT_TRUE(torch::allclose(hadamard16(x), want_h, 1e-6, 1e-30 + 1e-6 * x.abs().max().item<float>()));
  }
  RecordProperty("compared_codes", static_cast<int>(compared));
  EXPECT_GT(compared, 1000000);
}

}  // namespace
}  // namespace fp8
}  // namespace ampx
