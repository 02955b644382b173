// ampx-train's checkpoint files, on real files in a temporary folder: exact
// round trips (every byte value, a real LibTorch archive), atomic replacement,
// the documented layout built by hand, and every error text of read_checkpoint
// (which also must leave a damaged file as it found it). What a resume checks
// and takes from the description: checkpoint_resume_test.cpp.

#include "run/checkpoint.h"

#include <c10/util/Exception.h>
#include "checkpoint_fixture.h"
#include "test_support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <zlib.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using ampx::train::Checkpoint;
using ampx::train::kCheckpointVersion;
using ampx::train::read_checkpoint;
using ampx::train::write_checkpoint;
using nlohmann::json;
using namespace ampx::train::test;

constexpr size_t kHeaderBytes = 32;  // magic 8, version 4, two lengths 8 + 8, CRC 4

template <typename T>
void put_le(std::string& out, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    out.push_back(static_cast<char>((static_cast<uint64_t>(value) >> (8 * i)) & 0xff));
  }
}

template <typename T>
void patch_le(std::string& bytes, size_t offset, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    bytes[offset + i] = static_cast<char>((static_cast<uint64_t>(value) >> (8 * i)) & 0xff);
  }
}

uint32_t get_le32(const std::string& bytes, size_t offset) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) {
    v |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[offset + i])) << (8 * i);
  }
  return v;
}

/// zlib's CRC-32 of `bytes`, computed here independently of checkpoint.cpp.
uint32_t crc32_of(const std::string& bytes) {
  const uLong crc = ::crc32(::crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(bytes.data()),
                            static_cast<uInt>(bytes.size()));
  return static_cast<uint32_t>(crc);
}

std::string hex(uint32_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

/// A checkpoint framed by hand from the layout documented in checkpoint.h.
std::string frame(const std::string& meta_text, const std::string& payload,
                  uint32_t version = kCheckpointVersion) {
  std::string out = "AMPXCKPT";
  put_le<uint32_t>(out, version);
  put_le<uint64_t>(out, meta_text.size());
  put_le<uint64_t>(out, payload.size());
  put_le<uint32_t>(out, crc32_of(meta_text + payload));
  return out + meta_text + payload;
}

TEST_F(TrainCheckpointTest, RoundTripsMetaAndEveryByteValue) {
  const json meta = sample_meta();
  const std::string payload = all_byte_values();
  write_checkpoint(path_, meta, payload);
  const Checkpoint c = read_checkpoint(path_);
  EXPECT_EQ(c.meta, meta);
  ASSERT_EQ(c.payload.size(), payload.size());
  EXPECT_TRUE(c.payload == payload) << "payload bytes differ";
  EXPECT_EQ(fs::file_size(path_), kHeaderBytes + meta.dump().size() + payload.size());
}

TEST_F(TrainCheckpointTest, RoundTripsAnEmptyPayload) {
  write_checkpoint(path_, sample_meta(), "");
  const Checkpoint c = read_checkpoint(path_);
  EXPECT_EQ(c.meta, sample_meta());
  EXPECT_TRUE(c.payload.empty());
}

TEST_F(TrainCheckpointTest, RoundTripsATorchArchive) {
  torch::manual_seed(3);
  const auto weight = torch::randn({5, 7});
  const auto ids = torch::arange(-4, 9, torch::kLong);
  const auto half = torch::randn({3, 2}).to(torch::kBFloat16);
  std::ostringstream buffer;
  {
    torch::serialize::OutputArchive out;
    out.write("weight", weight);
    out.write("ids", ids);
    out.write("half", half);
    out.save_to(buffer);
  }
  write_checkpoint(path_, sample_meta(), buffer.str());

  const Checkpoint c = read_checkpoint(path_);
  ASSERT_EQ(c.payload, buffer.str());
  std::istringstream in(c.payload);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  torch::Tensor weight_back, ids_back, half_back;
  archive.read("weight", weight_back);
  archive.read("ids", ids_back);
  archive.read("half", half_back);
  EXPECT_TRUE(torch::equal(weight_back, weight));
  EXPECT_TRUE(torch::equal(ids_back, ids));
  EXPECT_EQ(half_back.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(half_back, half));
}

// read_payload hands LibTorch only the TorchScript source OutputArchive
// writes: an archive with every kind of attribute (tensors as parameters and
// buffers, int, float, str, nested archives, 3000 entries in one list) is
// read; the same archive with its class source changed is refused before
// LibTorch compiles it (LibTorch 1.13 crashes on some such sources:
// tests/fuzz/regressions/checkpoint_crc/), and so is one whose data.pkl means
// something OutputArchive never writes.
TEST_F(TrainCheckpointTest, ReadPayloadRefusesTorchScriptSourceOutputArchiveNeverWrites) {
  std::ostringstream buffer;
  {
    torch::serialize::OutputArchive out, nested;
    out.write("weight", torch::ones({2}));
    out.write("mask", torch::zeros({2}), /*is_buffer=*/true);
    out.write("step", c10::IValue(int64_t{7}));
    out.write("lr", c10::IValue(0.5));
    out.write("name", c10::IValue(std::string("adamw")));
    for (int i = 0; i < 3000; ++i) {
      nested.write("group0.param" + std::to_string(i) + ".exp_avg", torch::zeros({1}), true);
    }
    out.write("optimizer", nested);
    out.save_to(buffer);
  }
  const std::string payload = buffer.str();
  auto read_back = [&](const std::string& bytes) {
    write_checkpoint(path_, sample_meta(), bytes);
    const Checkpoint c = read_checkpoint(path_);
    torch::serialize::InputArchive archive;
    ampx::train::read_payload(path_, c, archive);
    return archive;
  };
  auto archive = read_back(payload);
  c10::IValue step;
  archive.read("step", step);
  EXPECT_EQ(step.toInt(), 7);

  // A small archive, whose class source LibTorch stores as is (larger ones
  // are deflated): its source changed in place, the same length, with the
  // checkpoint's CRC made to fit as a hostile file would.
  std::ostringstream small;
  {
    torch::serialize::OutputArchive out;
    out.write("weight", torch::ones({2}));
    out.write("step", c10::IValue(int64_t{7}));
    out.save_to(small);
  }
  read_back(small.str());
  const auto mutated = [&](const std::string& from, const std::string& to) {
    EXPECT_EQ(from.size(), to.size());
    std::string bytes = small.str();
    const size_t at = bytes.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) bytes.replace(at, from.size(), to);
    return error_text([&] { read_back(bytes); });
  };
  EXPECT_EQ(mutated("__parameters__ = [", "__parameteri__ = ["),
            where() +
                ": TorchScript source 'archive/code/__torch__.py' line 2 is not an "
                "attribute declaration that torch::serialize::OutputArchive writes: "
                "'  __parameteri__ = [\"weight\", ]'");
  EXPECT_NE(mutated("step : int", "step : Any").find("line 5 is not an attribute declaration"),
            std::string::npos);
  EXPECT_NE(mutated("class Module(Module):", "class Module(Object):")
                .find("line 1 is not the class header"),
            std::string::npos);
  // data.pkl: the storage's persistent id built as a dict instead of a tuple
  // (crashed LibTorch 1.13's unpickler), and a tensor of 3 elements over a
  // storage of 2 (a view past its storage).
  const std::string not_archive = "the archive's data.pkl is not what torch::serialize::";
  const std::string dict_id = mutated(std::string("K\x02tQ", 4), std::string("K\x02"
                                                                             "dQ",
                                                                             4));
  EXPECT_NE(dict_id.find(not_archive), std::string::npos) << dict_id;
  EXPECT_NE(mutated(std::string("(K\x02t(K\x01t", 8), std::string("(K\x03t(K\x01t", 8))
                .find("a view that reaches past its storage"),
            std::string::npos);
}

TEST_F(TrainCheckpointTest, WritesTheDocumentedLayout) {
  const json meta = sample_meta();
  const std::string payload = all_byte_values();
  write_checkpoint(path_, meta, payload);
  EXPECT_TRUE(read_bytes(path_) == frame(meta.dump(), payload)) << "bytes differ from the layout";
}

TEST_F(TrainCheckpointTest, ReadsAFileFramedByHand) {
  write_bytes(path_, frame(R"({"step": 3, "run": {"precision": "O1"}})", "xyz"));
  const Checkpoint c = read_checkpoint(path_);
  EXPECT_EQ(c.meta, json({{"step", 3}, {"run", {{"precision", "O1"}}}}));
  EXPECT_EQ(c.payload, "xyz");
}

TEST_F(TrainCheckpointTest, ReplacesAtomicallyAndLeavesNoTemporaryFile) {
  write_checkpoint(path_, sample_meta(), "first payload");
  json second = sample_meta();
  second["step"] = 8;
  write_checkpoint(path_, second, "second, longer payload");

  const Checkpoint c = read_checkpoint(path_);
  EXPECT_EQ(c.meta, second);
  EXPECT_EQ(c.payload, "second, longer payload");
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(run_dir_)) {
    names.push_back(entry.path().filename().string());
  }
  EXPECT_EQ(names, std::vector<std::string>{"checkpoint.ampx"});
  for (const auto& name : names) EXPECT_EQ(name.find(".tmp."), std::string::npos) << name;
}

TEST_F(TrainCheckpointTest, NamesAMissingFile) {
  const fs::path missing = run_dir_ / "absent.ampx";
  EXPECT_EQ(error_text([&] { read_checkpoint(missing); }),
            "ampx-train: cannot open checkpoint '" + missing.string() + "'");
  EXPECT_FALSE(fs::exists(missing)) << "reading must not create the file";
}

TEST_F(TrainCheckpointTest, RejectsATextFile) {
  const std::string text = "step 7\nthis is a text file, not a checkpoint\n";
  EXPECT_EQ(read_error(text), where() + " is not an ampx-train checkpoint (no AMPXCKPT header; " +
                                  std::to_string(text.size()) + " bytes)");
}

TEST_F(TrainCheckpointTest, RejectsAnEmptyFile) {
  EXPECT_EQ(read_error(""),
            where() + " is not an ampx-train checkpoint (no AMPXCKPT header; 0 bytes)");
}

TEST_F(TrainCheckpointTest, RejectsAnotherFormatVersion) {
  const std::string good = write_good();
  for (uint32_t version : {0u, 2u, 0xffffffffu}) {
    std::string bytes = good;
    patch_le<uint32_t>(bytes, 8, version);
    EXPECT_EQ(read_error(bytes), where() + " has format version " + std::to_string(version) +
                                     "; this ampx-train reads version 1");
  }
}

TEST_F(TrainCheckpointTest, RejectsAFileCutInsideTheMagic) {
  const std::string good = write_good();
  for (size_t n : {1, 4, 7}) {
    EXPECT_EQ(read_error(good.substr(0, n)),
              where() + " is not an ampx-train checkpoint (no AMPXCKPT header; " +
                  std::to_string(n) + " bytes)")
        << n;
  }
}

TEST_F(TrainCheckpointTest, RejectsAFileCutInsideTheHeader) {
  const std::string good = write_good();
  for (size_t n : {8, 12, 20, 28, 31}) {
    EXPECT_EQ(read_error(good.substr(0, n)), where() + " is truncated: " + std::to_string(n) +
                                                 " bytes, shorter than its 32-byte header")
        << n;
  }
}

TEST_F(TrainCheckpointTest, RejectsAFileCutInsideTheContent) {
  const std::string good = write_good();
  const size_t meta = sample_meta().dump().size(), payload = all_byte_values().size();
  const std::string promises = " is truncated: its header promises " + std::to_string(meta) +
                               " + " + std::to_string(payload) +
                               " bytes of content, the file holds ";
  for (size_t n : {kHeaderBytes, kHeaderBytes + 1, kHeaderBytes + meta - 1, kHeaderBytes + meta,
                   good.size() - 1}) {
    EXPECT_EQ(read_error(good.substr(0, n)), where() + promises + std::to_string(n - kHeaderBytes))
        << n;
  }
}

TEST_F(TrainCheckpointTest, RejectsLengthsThatWouldOverflow) {
  std::string bytes = write_good();
  patch_le<uint64_t>(bytes, 12, ~uint64_t{0});
  const size_t payload = all_byte_values().size();
  EXPECT_EQ(read_error(bytes), where() +
                                   " is truncated: its header promises 18446744073709551615 + " +
                                   std::to_string(payload) + " bytes of content, the file holds " +
                                   std::to_string(bytes.size() - kHeaderBytes));
}

TEST_F(TrainCheckpointTest, RejectsTrailingBytes) {
  EXPECT_EQ(read_error(write_good() + "abc"),
            where() + " is corrupted: 3 bytes past the end its header gives");
}

TEST_F(TrainCheckpointTest, DetectsOneFlippedBitInThePayload) {
  std::string bytes = write_good();
  bytes[bytes.size() - 100] ^= 0x10;
  const std::string expected = where() + " is corrupted: CRC-32 of its content is " +
                               hex(crc32_of(bytes.substr(kHeaderBytes))) + ", the header says " +
                               hex(get_le32(bytes, 28));
  EXPECT_EQ(read_error(bytes), expected);
  EXPECT_NE(crc32_of(bytes.substr(kHeaderBytes)), get_le32(bytes, 28));
}

TEST_F(TrainCheckpointTest, DetectsOneFlippedBitInTheMeta) {
  std::string bytes = write_good();
  // Inside "ampx-train checkpoint": still valid JSON, so only the CRC can tell.
  const size_t at = bytes.find("ampx-train checkpoint", kHeaderBytes);
  ASSERT_NE(at, std::string::npos);
  bytes[at] ^= 0x01;
  EXPECT_EQ(read_error(bytes), where() + " is corrupted: CRC-32 of its content is " +
                                   hex(crc32_of(bytes.substr(kHeaderBytes))) +
                                   ", the header says " + hex(get_le32(bytes, 28)));
}

TEST_F(TrainCheckpointTest, DetectsOneFlippedBitInTheStoredCrc) {
  const std::string good = write_good();
  std::string bytes = good;
  bytes[29] ^= 0x80;
  EXPECT_EQ(read_error(bytes), where() + " is corrupted: CRC-32 of its content is " +
                                   hex(get_le32(good, 28)) + ", the header says " +
                                   hex(get_le32(good, 28) ^ 0x8000u));
}

TEST_F(TrainCheckpointTest, RejectsAnUnreadableDescription) {
  EXPECT_TRUE(expect_error_contains(
      [&] {
        write_bytes(path_, frame("{\"step\": 1, \"run\":", "payload"));
        read_checkpoint(path_);
      },
      {where() + " has an unreadable description: ", "parse error"}));
}

TEST_F(TrainCheckpointTest, RejectsADescriptionWithoutRunOrStep) {
  for (const char* meta : {R"({"step": 1})", R"({"run": {}})", R"([1, 2])", R"("text")"}) {
    EXPECT_EQ(read_error(frame(meta, "payload")), where() + " has no run description or step")
        << meta;
  }
}

}  // namespace
