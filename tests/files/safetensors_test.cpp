// ampx/safetensors.h: the file format byte for byte, round trips of every
// dtype, modules in and out, and a clear error for each way a file from
// outside can be wrong.

#include "ampx/safetensors.h"

#include "ampx/fp8/linear.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        fs::temp_directory_path() /
        ("ampx-safetensors-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
         "-" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  static std::string bytes_of(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  // A file of `header` (its length prefixed) and `data`.
  std::string file_with(const std::string& header, const std::string& data) const {
    const std::string p = path("crafted.safetensors");
    const uint64_t n = header.size();
    std::string bytes(8, '\0');
    std::memcpy(bytes.data(), &n, 8);
    std::ofstream(p, std::ios::binary) << bytes << header << data;
    return p;
  }
  static std::string error_of(const std::string& p) {
    return error_in([&] { ampx::read_safetensors(p); });
  }
  static std::string contents_error_of(const std::string& p) {
    return error_in([&] { ampx::read_safetensors_contents(p); });
  }
  static std::string error_in(const std::function<void()>& fn) {
    try {
      fn();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "";
  }

  fs::path dir_;
};

// What the format says, written by hand: u64 header length, the JSON header
// padded with spaces to an 8-byte boundary, the raw little-endian bytes.
TEST_F(SafetensorsTest, WritesTheFormatByteForByte) {
  const auto t = torch::tensor({1.0f, -2.0f, 0.5f});
  ampx::save_safetensors({{"w", t}}, path("one.safetensors"), {{"format", "pt"}});
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})";
  std::string padded = header + std::string((8 - (8 + header.size()) % 8) % 8, ' ');
  const uint64_t n = padded.size();
  std::string want(8, '\0');
  std::memcpy(want.data(), &n, 8);
  want += padded;
  want.append(static_cast<const char*>(t.data_ptr()), 12);
  EXPECT_EQ(bytes_of(path("one.safetensors")), want);
}

TEST_F(SafetensorsTest, EveryDtypeRoundTripsBitwiseWithMetadata) {
  torch::manual_seed(3);
  std::map<std::string, torch::Tensor> tensors = {
      {"f64", torch::randn({2, 3}, torch::kDouble)},
      {"f32", torch::randn({4, 1, 2})},
      {"f16", torch::randn({5}).to(torch::kHalf)},
      {"bf16", torch::randn({3, 3}).to(torch::kBFloat16)},
      {"i64", torch::arange(-3, 4)},
      {"i32", torch::arange(0, 6, torch::kInt).reshape({2, 3})},
      {"i16", torch::arange(0, 4, torch::kShort)},
      {"i8", torch::arange(-4, 4, torch::kChar)},
      {"u8", torch::arange(0, 255, torch::kByte)},
      {"bool", torch::tensor({true, false, true})},
      {"scalar", torch::tensor(2.5f)},
      {"empty", torch::empty({0, 4})},
      {"strided \"name\"\n", torch::randn({4, 6}).t()},
  };
  ampx::save_safetensors(tensors, path("all.safetensors"), {{"a", "b"}, {"ünï", "x\"y"}});
  std::map<std::string, std::string> meta;
  const auto back = ampx::read_safetensors(path("all.safetensors"), &meta);
  EXPECT_EQ(meta, (std::map<std::string, std::string>{{"a", "b"}, {"ünï", "x\"y"}}));
  ASSERT_EQ(back.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(back.count(name)) << name;
    EXPECT_EQ(back.at(name).scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(back.at(name).sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(back.at(name), t)) << name;
  }
}

TEST_F(SafetensorsTest, ModulesGoOutAndComeBackWithBuffersAndConvertedDtypes) {
  torch::manual_seed(4);
  torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8),
                            torch::nn::Linear(8, 2));
  net->train();
  net->forward(torch::randn({16, 4}));  // running statistics move
  ampx::save_safetensors(*net, path("net.safetensors"));
  const auto names = ampx::read_safetensors(path("net.safetensors"));
  EXPECT_TRUE(names.count("1.running_mean") && names.count("1.num_batches_tracked") &&
              names.count("0.weight") && names.count("2.bias"));

  torch::manual_seed(5);
  torch::nn::Sequential other(torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8),
                              torch::nn::Linear(8, 2));
  ampx::load_safetensors(*other, path("net.safetensors"));
  const auto a = net->named_parameters(), b = other->named_parameters();
  for (const auto& p : a) EXPECT_TRUE(torch::equal(p.value(), b[p.key()])) << p.key();
  EXPECT_TRUE(
      torch::equal(net->named_buffers()["1.running_var"], other->named_buffers()["1.running_var"]));
  // A bfloat16 file into a float32 module converts, as load_state_dict does.
  std::map<std::string, torch::Tensor> low;
  for (const auto& [name, t] : names) {
    low[name] = t.is_floating_point() ? t.to(torch::kBFloat16) : t;
  }
  ampx::save_safetensors(low, path("bf16.safetensors"));
  ampx::load_safetensors(*other, path("bf16.safetensors"));
  EXPECT_TRUE(
      torch::equal(other->named_parameters()["0.weight"], low["0.weight"].to(torch::kFloat)));
}

TEST_F(SafetensorsTest, LoadingIntoAModuleNamesWhatDoesNotFitAndChangesNothing) {
  torch::nn::Linear small(4, 2), wide(4, 3);
  torch::nn::Sequential two(torch::nn::Linear(4, 2));
  ampx::save_safetensors(*small, path("small.safetensors"));
  const auto before = wide->weight.clone();
  std::string text;
  try {
    ampx::load_safetensors(*wide, path("small.safetensors"));
  } catch (const c10::Error& e) {
    text = e.what_without_backtrace();
  }
  EXPECT_THAT(text, HasSubstr("tensor 'bias' has shape [2] in the file and [3] in the module"));
  EXPECT_TRUE(torch::equal(wide->weight, before));
  try {
    ampx::load_safetensors(*two, path("small.safetensors"));
  } catch (const c10::Error& e) {
    text = e.what_without_backtrace();
  }
  EXPECT_THAT(text, HasSubstr("does not fit this module: missing 0.bias, 0.weight; unexpected "
                              "bias, weight;"));
}

// Each way a file from outside can be wrong: a clear error naming it, never a
// crash or an allocation the file does not back.
TEST_F(SafetensorsTest, BadFilesGetAnErrorSayingWhatIsWrong) {
  const std::string ok = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string eight(8, '\x01');
  EXPECT_EQ(error_of(file_with(ok, eight)), "");
  {
    std::ofstream(path("short"), std::ios::binary) << "abc";
    EXPECT_THAT(error_of(path("short")), HasSubstr("shorter than its 8-byte header length"));
  }
  {
    std::string huge(8, '\0');
    const uint64_t n = uint64_t{1} << 40;
    std::memcpy(huge.data(), &n, 8);
    std::ofstream(path("huge"), std::ios::binary) << huge << ok;
    EXPECT_THAT(error_of(path("huge")), HasSubstr("safetensors headers are at most 100000000"));
  }
  {
    std::string cut(8, '\0');
    const uint64_t n = ok.size() + 100;
    std::memcpy(cut.data(), &n, 8);
    std::ofstream(path("cut"), std::ios::binary) << cut << ok;
    EXPECT_THAT(error_of(path("cut")), HasSubstr("is truncated: its header needs"));
  }
  EXPECT_THAT(
      error_of(file_with(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", eight)),
      HasSubstr("expected '}'"));
  EXPECT_THAT(error_of(file_with(R"({"w":{"dtype":"F32","shape":[2]}})", eight)),
              HasSubstr("a tensor entry without dtype, shape and data_offsets"));
  EXPECT_THAT(
      error_of(file_with(R"({"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", eight)),
      HasSubstr("tensor 'w' has dtype 'Q4', which ampx does not read"));
  EXPECT_THAT(
      error_of(file_with(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight)),
      HasSubstr("needs 12 bytes, its data_offsets give 8"));
  EXPECT_THAT(
      error_of(file_with(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", eight)),
      HasSubstr("outside the 8 bytes of data"));
  EXPECT_THAT(error_of(file_with(ok, eight + "xx")),
              HasSubstr("2 bytes after the last tensor's data belong to no tensor"));
  // Spaces pad the header (as ampx and the reference writer pad it); anything
  // else after its object is an error, a second object too.
  EXPECT_EQ(error_of(file_with(ok + " \t\r\n ", eight)), "");
  EXPECT_THAT(error_of(file_with(ok + "  x", eight)),
              HasSubstr("text after the header's object at byte 56"));
  EXPECT_THAT(error_of(file_with(ok + ok, eight)),
              HasSubstr("text after the header's object at byte 54"));
  EXPECT_THAT(error_of(file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                 R"("b":{"dtype":"F32","shape":[2],"data_offsets":[2,10]}})",
                                 eight + "xx")),
              HasSubstr("its tensors' data overlap at byte 2"));
  EXPECT_THAT(error_of(file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                 R"("b":{"dtype":"F32","shape":[1],"data_offsets":[6,10]}})",
                                 eight + "xx")),
              HasSubstr("its tensors' data leave a gap at byte 4"));
  EXPECT_THAT(error_of(file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                 R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                 eight)),
              HasSubstr("the header names 'a' twice"));
  EXPECT_THAT(error_of(file_with(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],)"
                                 R"("data_offsets":[0,8]}})",
                                 eight)),
              HasSubstr("has a shape larger than the file"));
  EXPECT_THAT(error_of(file_with(R"({"w":{"dtype":"F32","shape":[99999999999999999999],)"
                                 R"("data_offsets":[0,8]}})",
                                 eight)),
              HasSubstr("an integer too large"));
  EXPECT_THAT(error_of(file_with(R"({"w\ud800":{}})", eight)),
              HasSubstr("a lone high surrogate at byte 9"));
  EXPECT_THAT(error_of(path("missing")), HasSubstr("cannot open"));
}

// Each way the header's JSON can be wrong: the fault and the byte of the
// header where the parser found it.
TEST_F(SafetensorsTest, BadHeaderTextGetsAnErrorNamingItsByte) {
  const std::string entry = R"("dtype":"F32","shape":[2],"data_offsets":[0,8])";
  std::string dims65 = "[1";  // 65 dimensions of size 1
  for (int k = 0; k < 64; ++k) dims65 += ",1";
  dims65 += "]";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"w":)", "expected '{' at byte 5"},
      {R"({"w)", "a string without its closing quote at byte 3"},
      {"{\"w\\", "a string without its closing quote at byte 4"},
      {"{\"w\nx\":{}}", "a control character in a string at byte 4"},
      {R"({"\q":{}})", "an unknown escape \\q at byte 4"},
      {R"({"\u12)", "a \\u escape cut short at byte 4"},
      {R"({"\u12g4":{}})", "a \\u escape with a non-hex digit at byte 7"},
      {R"({"\ud800\u0041":{}})", "a high surrogate without its low one at byte 14"},
      {R"({"\udc00":{}})", "a lone low surrogate at byte 8"},
      {R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})",
       "expected a non-negative integer at byte 29"},
      {R"({"w":{"dtype":"F32","shape":)" + dims65 + R"(,"data_offsets":[0,8]}})",
       "more than 64 dimensions at byte 157"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}})",
       "data_offsets that are not [begin, end] at byte 54"},
      {R"({"w":{)" + entry + R"(,"dtype":"F32"}})",
       "an unexpected or repeated key 'dtype' in a tensor entry at byte 61"},
      {R"({"w":{)" + entry + R"(,"offsets":[0,8]}})",
       "an unexpected or repeated key 'offsets' in a tensor entry at byte 63"},
  };
  for (const auto& [header, want] : cases) {
    EXPECT_THAT(error_of(file_with(header, std::string(8, '\x01'))), HasSubstr(want)) << header;
  }
}

// Characters outside the Basic Multilingual Plane, escaped as JSON escapes
// them (a UTF-16 surrogate pair, RFC 8259 section 7), read back in tensor
// names and metadata as their UTF-8 bytes, one 4-byte sequence each, not
// one 3-byte sequence per half (CESU-8). The bytes are the Unicode
// Standard's: U+10302 (its table 3-5) is D800 DF02 in UTF-16, F0 90 8C 82
// in UTF-8; U+1F600 is D83D DE00, F0 9F 98 80; U+10FFFF, the last code
// point, DBFF DFFF, F4 8F BF BF. ampx's writer keeps such a name as UTF-8.
TEST_F(SafetensorsTest, EscapedSurrogatePairsReadBackAsUtf8) {
  const std::string header =
      R"({"__metadata__":{"note":"\ud83d\ude00","\uD800\uDF02":"\udbff\udfff"},)"
      R"("w\ud83d\ude00":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  std::map<std::string, std::string> metadata;
  const auto tensors = ampx::read_safetensors(file_with(header, std::string(4, '\0')), &metadata);
  const std::string grin = "\xF0\x9F\x98\x80";
  ASSERT_EQ(tensors.size(), 1u);
  EXPECT_EQ(tensors.begin()->first, "w" + grin);
  const std::map<std::string, std::string> want = {{"note", grin},
                                                   {"\xF0\x90\x8C\x82", "\xF4\x8F\xBF\xBF"}};
  EXPECT_EQ(metadata, want);

  ampx::save_safetensors(tensors, path("again.safetensors"), metadata);
  std::map<std::string, std::string> again;
  EXPECT_EQ(ampx::read_safetensors(path("again.safetensors"), &again).begin()->first, "w" + grin);
  EXPECT_EQ(again, want);
}

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
  EXPECT_THAT(error_in([&] { ampx::save_safetensors(c, path("x.safetensors")); }),
              HasSubstr("two entries are named 'w_scale' (one of them the scale of FP8 tensor "
                        "'w')"));
  c.tensors.clear();
  c.fp8["w"].codes = torch::zeros({2});
  EXPECT_THAT(error_in([&] { ampx::save_safetensors(c, path("x.safetensors")); }),
              HasSubstr("FP8 tensor 'w' has codes of dtype Float; an Fp8Tensor's codes are uint8"));
  c.fp8["w"] = all_codes(Fp8Format::kE4M3, 2.0f);
  c.fp8["w"].scale_inv = torch::ones({2});
  EXPECT_THAT(error_in([&] { ampx::save_safetensors(c, path("x.safetensors")); }),
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
  EXPECT_THAT(error_in([&] { ampx::load_safetensors(*bn, path("bn_fp8.safetensors")); }),
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
