// ampx/safetensors.h's FP8 tensors: codes and their scale entries byte for
// byte, round trips with their formats, the plain reader's float8 tensors,
// other writers' scales, refusals, and FP8 layers in and out of modules.

#include "ampx/fp8/linear.h"
#include "ampx/safetensors.h"

#include "safetensors_fixture.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

namespace {

namespace fs = std::filesystem;
using ampx::test::error_text;
using ampx::test::SafetensorsTest;
using ::testing::HasSubstr;

using ampx::fp8::Fp8Format;
using ampx::fp8::Fp8Tensor;

// Every code of `format` (NaNs and E5M2's infs among them) with a scale_inv
// that is not a power of two, as quantize() makes them.
Fp8Tensor all_codes(Fp8Format format, float scale) {
  return {torch::arange(256, torch::kLong).to(torch::kByte).reshape({16, 16}),
          torch::ones({1}) / torch::full({1}, scale), format};
}

// The FP8 layout, written by hand: the codes' bytes under F8_E4M3, then the
// scale entry "<name>_scale" as F32 holding scale_inv (names in order).
TEST_F(SafetensorsTest, WritesFp8CodesAndTheirScaleByteForByte) {
  const Fp8Tensor t{torch::tensor({0x38, 0xFE}, torch::kByte), torch::full({}, 0.25f),
                    Fp8Format::kE4M3};
  ampx::SafetensorsContents contents;
  contents.fp8["w"] = t;
  ampx::save_safetensors(contents, path("fp8.safetensors"));
  const std::string header = R"({"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]},)"
                             R"("w_scale":{"dtype":"F32","shape":[],"data_offsets":[2,6]}})";
  std::string padded = header + std::string((8 - (8 + header.size()) % 8) % 8, ' ');
  const uint64_t n = padded.size();
  std::string want(8, '\0');
  std::memcpy(want.data(), &n, 8);
  const float quarter = 0.25f;
  want += padded + "\x38\xFE" + std::string(reinterpret_cast<const char*>(&quarter), 4);
  EXPECT_EQ(bytes_of(path("fp8.safetensors")), want);
  EXPECT_EQ(ampx::fp8_scale_name("blocks.0.fc.weight"), "blocks.0.fc.weight_scale");
}

TEST_F(SafetensorsTest, Fp8TensorsRoundTripBitwiseWithTheirScalesAndFormats) {
  ampx::SafetensorsContents out;
  out.fp8["e4m3"] = all_codes(Fp8Format::kE4M3, 3.7f);
  out.fp8["e5m2"] = all_codes(Fp8Format::kE5M2, 0.013f);
  torch::manual_seed(7);
  out.fp8["quantized"] =
      Fp8Tensor::quantize(torch::randn({3, 5}) * 40, Fp8Format::kE4M3, torch::full({1}, 2.5f));
  out.tensors["bias"] = torch::randn({5});
  out.metadata["format"] = "pt";
  ampx::save_safetensors(out, path("fp8.safetensors"));
  const auto back = ampx::read_safetensors_contents(path("fp8.safetensors"));
  EXPECT_EQ(back.metadata, out.metadata);
  ASSERT_EQ(back.tensors.size(), 1u);
  EXPECT_TRUE(torch::equal(back.tensors.at("bias"), out.tensors.at("bias")));
  ASSERT_EQ(back.fp8.size(), 3u);
  for (const auto& [name, t] : out.fp8) {
    const auto& got = back.fp8.at(name);
    EXPECT_EQ(got.format, t.format) << name;
    EXPECT_EQ(got.codes.scalar_type(), torch::kByte) << name;
    EXPECT_TRUE(torch::equal(got.codes, t.codes)) << name;
    EXPECT_EQ(got.scale_inv.scalar_type(), torch::kFloat) << name;
    EXPECT_TRUE(torch::equal(got.scale_inv, t.scale_inv)) << name;  // bitwise: finite floats
    // The values (NaN codes too) as their bits.
    EXPECT_TRUE(torch::equal(got.dequantize().view(torch::kInt), t.dequantize().view(torch::kInt)))
        << name;
  }
}

// read_safetensors gives PyTorch's float8 tensors where LibTorch has the
// dtypes and refuses, naming the reader that can, where it has none: never
// the codes as uint8, which would read as integers.
TEST_F(SafetensorsTest, PlainReaderGivesFloat8TensorsOrRefusesWithoutTheDtypes) {
  ampx::SafetensorsContents out;
  out.fp8["w"] = all_codes(Fp8Format::kE5M2, 2.0f);
  ampx::save_safetensors(out, path("fp8.safetensors"));
#if AMPX_HAS_TORCH_FLOAT8
  const auto plain = ampx::read_safetensors(path("fp8.safetensors"));
  ASSERT_EQ(plain.size(), 2u);
  EXPECT_EQ(plain.at("w").scalar_type(), torch::kFloat8_e5m2);
  EXPECT_TRUE(torch::equal(plain.at("w").view(torch::kByte), out.fp8.at("w").codes));
  EXPECT_TRUE(torch::equal(plain.at("w_scale"), out.fp8.at("w").scale_inv));
  // float8 tensors in a map go out as F8 and come back as the same contents.
  ampx::save_safetensors(plain, path("again.safetensors"));
  EXPECT_EQ(bytes_of(path("again.safetensors")), bytes_of(path("fp8.safetensors")));
#else
  EXPECT_THAT(error_of(path("fp8.safetensors")),
              HasSubstr("tensor 'w' is F8_E5M2, and LibTorch 1.13"));
  EXPECT_THAT(error_of(path("fp8.safetensors")),
              HasSubstr("has no float8 dtype (2.1 added them); "
                        "ampx::read_safetensors_contents() reads it"));
#endif
}

// An FP8 file from another framework: compressed-tensors' "<name>_scale",
// DeepSeek-V3's "<name>_scale_inv" in bf16, none at all (Python's
// x.to(torch.float8_e4m3fn)); and each way an FP8 entry can be wrong.
TEST_F(SafetensorsTest, Fp8ScalesOfOtherWritersAndBadFp8Entries) {
  const uint16_t bf16_quarter = 0x3E80;  // 0.25 in bfloat16
  std::string data = "\x38\xC0" + std::string(reinterpret_cast<const char*>(&bf16_quarter), 2);
  data += "\x3C";
  const auto contents =
      ampx::read_safetensors_contents(file_with(R"({"a":{"dtype":"F8_E4M3","shape":[2],)"
                                                R"("data_offsets":[0,2]},)"
                                                R"("a_scale_inv":{"dtype":"BF16","shape":[1],)"
                                                R"("data_offsets":[2,4]},)"
                                                R"("b":{"dtype":"F8_E5M2","shape":[1],)"
                                                R"("data_offsets":[4,5]}})",
                                                data));
  EXPECT_TRUE(contents.tensors.empty());
  ASSERT_EQ(contents.fp8.size(), 2u);
  EXPECT_TRUE(torch::equal(contents.fp8.at("a").dequantize(), torch::tensor({0.25f, -0.5f})));
  EXPECT_EQ(contents.fp8.at("a").format, Fp8Format::kE4M3);
  EXPECT_EQ(contents.fp8.at("b").format, Fp8Format::kE5M2);
  EXPECT_TRUE(torch::equal(contents.fp8.at("b").dequantize(), torch::tensor({1.0f})));

  const std::string four(4, '\x3C');
  const std::string one_scale = "\x38\x38" + std::string("\0\0\x80\x3F", 4);  // codes, 1.0f
  EXPECT_THAT(contents_error_of(
                  file_with(R"({"w":{"dtype":"F8_E4M3","shape":[3],"data_offsets":[0,4]}})", four)),
              HasSubstr("tensor 'w' of shape [3] and dtype F8_E4M3 needs 3 bytes, its "
                        "data_offsets give 4"));
  EXPECT_THAT(contents_error_of(file_with(
                  R"({"w":{"dtype":"F8_E4M3FN","shape":[4],"data_offsets":[0,4]}})", four)),
              HasSubstr("tensor 'w' has dtype 'F8_E4M3FN', which ampx does not read"));
  EXPECT_THAT(
      contents_error_of(file_with(R"({"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]},)"
                                  R"("w_scale":{"dtype":"F16","shape":[1],"data_offsets":[2,4]},)"
                                  R"("w_scale_inv":{"dtype":"F16","shape":[1],)"
                                  R"("data_offsets":[4,6]}})",
                                  four + std::string(2, '\0'))),
      HasSubstr("FP8 tensor 'w' has two scales, 'w_scale' and 'w_scale_inv'"));
  EXPECT_THAT(
      contents_error_of(file_with(R"({"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]},)"
                                  R"("w_scale":{"dtype":"F16","shape":[2,1],)"
                                  R"("data_offsets":[2,6]}})",
                                  "\x38\x38" + four)),
      HasSubstr("'w_scale', the scale of FP8 tensor 'w', has shape [2, 1]; ampx reads "
                "per-tensor scales"));
  EXPECT_THAT(
      contents_error_of(file_with(R"({"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]},)"
                                  R"("w_scale":{"dtype":"I32","shape":[],"data_offsets":[2,6]}})",
                                  one_scale)),
      HasSubstr("'w_scale', the scale of FP8 tensor 'w', is I32; a scale is F32, BF16 or F16"));
  EXPECT_THAT(
      contents_error_of(file_with(R"({"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]},)"
                                  R"("w_scale":{"dtype":"F8_E5M2","shape":[4],)"
                                  R"("data_offsets":[2,6]}})",
                                  one_scale)),
      HasSubstr("is F8_E5M2; a scale is F32, BF16 or F16"));
}

TEST_F(SafetensorsTest, SavingRefusesBadFp8TensorsAndNamesUsedTwice) {
  ampx::SafetensorsContents c;
  c.fp8["w"] = all_codes(Fp8Format::kE4M3, 2.0f);
  c.tensors["w_scale"] = torch::ones({1});
  EXPECT_THAT(error_text([&] { ampx::save_safetensors(c, path("x.safetensors")); }),
              HasSubstr("two entries are named 'w_scale' (one of them the scale of FP8 tensor "
                        "'w')"));
  c.tensors.clear();
  c.fp8["w"].codes = torch::zeros({2});
  EXPECT_THAT(error_text([&] { ampx::save_safetensors(c, path("x.safetensors")); }),
              HasSubstr("FP8 tensor 'w' has codes of dtype Float; an Fp8Tensor's codes are uint8"));
  c.fp8["w"] = all_codes(Fp8Format::kE4M3, 2.0f);
  c.fp8["w"].scale_inv = torch::ones({2});
  EXPECT_THAT(error_text([&] { ampx::save_safetensors(c, path("x.safetensors")); }),
              HasSubstr("FP8 tensor 'w' has a scale_inv of Float with 2 elements; it must be one "
                        "float32 element"));
  EXPECT_FALSE(fs::exists(path("x.safetensors")));
}

// An FP8 checkpoint into a float model: each FP8 entry's values (codes times
// its scale) go into the module's tensor of that name.
TEST_F(SafetensorsTest, LoadsFp8EntriesIntoAModuleAsTheirValues) {
  torch::manual_seed(8);
  torch::nn::Linear src(4, 3), dst(4, 3);
  ampx::SafetensorsContents c;
  c.fp8["weight"] =
      Fp8Tensor::quantize(src->weight.detach(), Fp8Format::kE4M3, torch::full({1}, 200.0f));
  c.tensors["bias"] = src->bias.detach();
  ampx::save_safetensors(c, path("fp8.safetensors"));
  ampx::load_safetensors(*dst, path("fp8.safetensors"));
  EXPECT_TRUE(torch::equal(dst->weight, c.fp8.at("weight").dequantize()));
  EXPECT_TRUE(torch::equal(dst->bias, src->bias));
  EXPECT_FALSE(torch::equal(dst->weight, src->weight));  // on the E4M3 grid now

  // An FP8 entry for an integer tensor of the module (a BatchNorm's
  // num_batches_tracked) is refused, not truncated into it.
  torch::nn::BatchNorm1d bn(2);
  ampx::save_safetensors(*bn, path("bn.safetensors"));
  auto bn_file = ampx::read_safetensors_contents(path("bn.safetensors"));
  bn_file.tensors.erase("num_batches_tracked");
  bn_file.fp8["num_batches_tracked"] =
      Fp8Tensor{torch::full({}, 0x38, torch::kByte), torch::ones({}), Fp8Format::kE4M3};
  ampx::save_safetensors(bn_file, path("bn_fp8.safetensors"));
  EXPECT_THAT(error_text([&] { ampx::load_safetensors(*bn, path("bn_fp8.safetensors")); }),
              HasSubstr("FP8 tensor 'num_batches_tracked' goes into a floating-point tensor; the "
                        "module's is Long"));
}

// ampx::fp8::Linear keeps its master weight in fp32 and its scaling state
// (amax histories, scales, scale_invs) in float32 buffers: a module file
// takes them all, and the loaded layer casts and multiplies as the saved one.
TEST_F(SafetensorsTest, Fp8LinearGoesOutAndComesBackWithItsScalingState) {
  torch::manual_seed(9);
  const auto recipe = ampx::fp8::DelayedScaling().amax_history_len(4);
  ampx::fp8::Linear fc(ampx::fp8::LinearOptions(16, 8).recipe(recipe));
  for (int step = 0; step < 2; ++step) {
    ampx::fp8::Fp8AutocastGuard fp8;
    fc->forward(torch::randn({4, 16}) * (step + 2)).sum().backward();
  }
  ampx::save_safetensors(*fc, path("fp8_linear.safetensors"));
  const auto names = ampx::read_safetensors(path("fp8_linear.safetensors"));
  EXPECT_TRUE(names.count("weight") && names.count("input_amax_history") &&
              names.count("weight_scale") && names.count("grad_output_scale_inv"));

  torch::manual_seed(10);
  ampx::fp8::Linear other(ampx::fp8::LinearOptions(16, 8).recipe(recipe));
  ampx::load_safetensors(*other, path("fp8_linear.safetensors"));
  for (const auto& p : fc->named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value(), other->named_parameters()[p.key()])) << p.key();
  }
  for (const auto& b : fc->named_buffers()) {
    EXPECT_TRUE(torch::equal(b.value(), other->named_buffers()[b.key()])) << b.key();
  }
  ASSERT_NE(other->input_state().scale().item<float>(), 1.0f);  // the state moved and came over
  const auto x = torch::randn({4, 16});
  ampx::fp8::Fp8AutocastGuard fp8;
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(fc->forward(x), other->forward(x)));
}

}  // namespace
