// ampx/safetensors.h: the file format byte for byte, round trips of every
// dtype, modules in and out, and a clear error for each way a file from
// outside can be wrong (FP8 tensors and their scales:
// safetensors_fp8_test.cpp).

#include "ampx/safetensors.h"

#include "safetensors_fixture.h"

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

using ::testing::HasSubstr;

using ampx::test::error_text;
using ampx::test::SafetensorsTest;

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
              HasSubstr("surrogate U+D800..U+DBFF must be followed by U+DC00..U+DFFF; last read: "
                        "'\"w\\ud800\"'; expected string literal at byte 9"));
  EXPECT_THAT(error_of(path("missing")), HasSubstr("cannot open"));
}

// Each way the header's JSON can be wrong: the fault and the byte of the
// header where the reading stopped (a token's last byte, the byte after a
// number, the header's length at its end): JSON's faults in nlohmann-json's
// words, the grammar's in ampx's.
TEST_F(SafetensorsTest, BadHeaderTextGetsAnErrorNamingItsByte) {
  const std::string entry = R"("dtype":"F32","shape":[2],"data_offsets":[0,8])";
  std::string dims65 = "[1";  // 65 dimensions of size 1
  for (int k = 0; k < 64; ++k) dims65 += ",1";
  dims65 += "]";
  const std::string lex =
      "not valid JSON: syntax error while parsing object key - invalid string: ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"w":)",
       "not valid JSON: syntax error while parsing value - unexpected end of input; "
       "expected '[', '{', or a literal at byte 5"},
      {R"({"w)",
       lex + "missing closing quote; last read: '\"w'; expected string literal at byte 3"},
      {"{\"w\\", lex + "forbidden character after backslash; last read: '\"w\\'"},
      {"{\"w\nx\":{}}", lex + "control character U+000A (LF) must be escaped to \\u000A or \\n; "
                              "last read: '\"w<U+000A>'; expected string literal at byte 3"},
      {R"({"\q":{}})", lex + "forbidden character after backslash; last read: '\"\\q'; expected "
                             "string literal at byte 3"},
      {R"({"\u12)", lex + "'\\u' must be followed by 4 hex digits; last read: '\"\\u12'; "
                          "expected string literal at byte 6"},
      {R"({"\u12g4":{}})", lex + "'\\u' must be followed by 4 hex digits; last read: "
                                 "'\"\\u12g'; expected string literal at byte 6"},
      {R"({"\ud800\u0041":{}})", lex + "surrogate U+D800..U+DBFF must be followed by "
                                       "U+DC00..U+DFFF; last read: '\"\\ud800\\u0041'; "
                                       "expected string literal at byte 13"},
      {R"({"\udc00":{}})", lex + "surrogate U+DC00..U+DFFF must follow U+D800..U+DBFF; last "
                                 "read: '\"\\udc00'; expected string literal at byte 7"},
      {"{\"w\xFF\":{}}", lex + "ill-formed UTF-8 byte; last read: '\"w\xFF'; expected "
                               "string literal at byte 3"},
      {R"({"w":5})", "expected '{' at byte 6"},
      {R"({"w":{"dtype":8,"shape":[2],"data_offsets":[0,8]}})", "expected a string at byte 15"},
      {R"({"w":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", "expected '[' at byte 29"},
      {R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})",
       "expected a non-negative integer at byte 31"},
      {R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})",
       "expected a non-negative integer at byte 32"},
      {R"({"w":{"dtype":"F32","shape":)" + dims65 + R"(,"data_offsets":[0,8]}})",
       "more than 64 dimensions at byte 158"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}})",
       "data_offsets that are not [begin, end] at byte 53"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8]}})",
       "data_offsets that are not [begin, end] at byte 49"},
      {R"({"w":{)" + entry + R"(,"dtype":"F32"}})",
       "an unexpected or repeated key 'dtype' in a tensor entry at byte 59"},
      {R"({"w":{)" + entry + R"(,"offsets":[0,8]}})",
       "an unexpected or repeated key 'offsets' in a tensor entry at byte 61"},
      {R"({"__metadata__":{"a":1}})", "expected a string at byte 22"},
      {R"({"__metadata__":{"a":{}}})", "expected a string at byte 21"},
      {R"({"__metadata__":null})", "expected '{' at byte 19"},
      {R"([])", "expected '{' at byte 0"},
      {R"({"w":{"dtype":"F32","shape":[[1]],"data_offsets":[0,8]}})",
       "expected a non-negative integer at byte 29"},
      {R"({"w":{"dtype":"F32","shape":[-0],"data_offsets":[0,8]}})",
       "expected a non-negative integer at byte 31"},
      // What nlohmann-json's reader would let by: a NUL (its end of input)
      // and a byte-order mark (skipped).
      {R"({"w":{)" + entry + "}}" + std::string(1, '\0') + "{",
       "a NUL byte, which JSON text never holds, at byte 54"},
      {"\xEF\xBB\xBF{}", "a byte-order mark, which JSON text must not start with, at byte 0"},
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

// What the grammar leaves open: no tensors at all, and the metadata after
// the entries.
TEST_F(SafetensorsTest, HeadersWithoutTensorsOrWithMetadataLastRead) {
  EXPECT_TRUE(ampx::read_safetensors(file_with("{}", "")).empty());
  std::map<std::string, std::string> metadata;
  const auto t = ampx::read_safetensors(
      file_with(R"({"w":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"__metadata__":{"a":"b"}})",
                std::string(4, '\0')),
      &metadata);
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t.at("w").dim(), 0);
  EXPECT_EQ(metadata, (std::map<std::string, std::string>{{"a", "b"}}));
}

// A header is JSON, which is UTF-8: a name or metadata string with other
// bytes would make a file no reader opens (ampx's, Python's), so the writer
// refuses it, naming it, and leaves the file that was there as it was.
TEST_F(SafetensorsTest, NamesThatAreNotUtf8AreRefusedAndNothingIsWritten) {
  const auto t = torch::tensor({1.0f});
  const std::string file = path("kept.safetensors");
  ampx::save_safetensors({{"w", t}}, file);
  const std::string before = bytes_of(file);
  const std::string latin1 = "w\xE9";  // "wé" in Latin-1
  EXPECT_THAT(error_text([&] {
                ampx::save_safetensors({{latin1, t}}, file);
              }),
              HasSubstr("save_safetensors: tensor name 'w\xE9' is not UTF-8, which a "
                        "safetensors header (JSON) must be"));
  EXPECT_THAT(error_text([&] {
                ampx::save_safetensors({{"w", t}}, file, {{"note", latin1}});
              }),
              HasSubstr("save_safetensors: the value of metadata key 'note' is not UTF-8"));
  EXPECT_THAT(error_text([&] {
                ampx::save_safetensors({{"w", t}}, file, {{latin1, "x"}});
              }),
              HasSubstr("save_safetensors: metadata key 'w\xE9' is not UTF-8"));
  EXPECT_EQ(bytes_of(file), before);
}

}  // namespace
