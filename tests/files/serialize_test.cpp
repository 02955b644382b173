// ampx::save_archive / load_archive: LibTorch archives (modules, optimizers,
// ZeroRedundancyOptimizer shards) written atomically and checked before
// LibTorch reads them. The crafted files come from fuzzing
// (tests/fuzz/regressions): LibTorch 1.13's own reader crashes on two of them.

#include <ampx/serialize.h>

#include "../test_util.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace {

namespace fs = std::filesystem;

class SerializeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "ampx-serialize-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

std::string read_whole(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_whole(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary) << bytes;
}

TEST_F(SerializeTest, ArchiveRoundTripsAModuleAndItsOptimizerBitwise) {
  torch::manual_seed(3);
  torch::nn::Linear model(5, 4);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  model->forward(torch::randn({6, 5})).pow(2).sum().backward();
  adam.step();
  torch::serialize::OutputArchive out, out_model, out_adam;
  model->save(out_model);
  adam.save(out_adam);
  out.write("model", out_model);
  out.write("adam", out_adam);
  const auto path = (dir_ / "state.pt").string();
  ampx::save_archive(out, path);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1)
      << "a temp file was left";

  torch::manual_seed(4);
  torch::nn::Linear other(5, 4);
  torch::optim::Adam other_adam(other->parameters(), torch::optim::AdamOptions(1e-2));
  torch::serialize::InputArchive in, in_model, in_adam;
  ampx::load_archive(in, path);
  in.read("model", in_model);
  in.read("adam", in_adam);
  other->load(in_model);
  other_adam.load(in_adam);
  EXPECT_TRUE(torch::equal(other->weight, model->weight));
  EXPECT_TRUE(torch::equal(other->bias, model->bias));
  // The moments came back too: one more identical step stays identical.
  adam.zero_grad();
  other_adam.zero_grad();
  for (auto* m : {&model, &other}) (*m)->forward(torch::ones({2, 5})).sum().backward();
  adam.step();
  other_adam.step();
  EXPECT_TRUE(torch::equal(other->weight, model->weight));
}

TEST_F(SerializeTest, LoadArchiveNamesAMissingEmptyOrForeignFile) {
  const auto missing = (dir_ / "missing.pt").string();
  torch::serialize::InputArchive in;
  EXPECT_EQ(ampx::test::error_text([&] {
              ampx::load_archive(in, missing);
            }).rfind("load_archive: cannot open '" + missing + "'", 0),
            0u);
  const auto empty = (dir_ / "empty.pt").string();
  write_whole(empty, "");
  EXPECT_EQ(ampx::test::error_text([&] { ampx::load_archive(in, empty); }),
            "load_archive: '" + empty + "' is empty");
  const auto text = (dir_ / "text.pt").string();
  write_whole(text, "model weights\n");
  EXPECT_EQ(ampx::test::error_text([&] {
              ampx::load_archive(in, text);
            }).rfind("load_archive: '" + text + "'", 0),
            0u);
}

// The LibTorch archives inside the checkpoints fuzzing made (their payload,
// after the 32-byte header and the JSON): each must be refused with an
// error. Without load_archive's checks, LibTorch 1.13 dies with SIGSEGV on
// the first two and reserves what a ~4 GiB length says on the third.
TEST_F(SerializeTest, LoadArchiveRefusesTheArchivesFuzzingFound) {
  const fs::path regressions = fs::path(AMPX_FUZZ_REGRESSIONS_DIR) / "checkpoint_crc";
  for (const char* name :
       {"libtorch-script-type-parser-segfault.bin", "libtorch-unpickler-persid-dict-segfault.bin",
        "unbounded-pickle-string-length.bin"}) {
    const std::string checkpoint = read_whole(regressions / name);
    ASSERT_GT(checkpoint.size(), 32u) << name;
    uint64_t meta = 0;
    for (int i = 7; i >= 0; --i)
      meta = (meta << 8) | static_cast<unsigned char>(checkpoint[12 + i]);
    ASSERT_LT(32 + meta, checkpoint.size()) << name;
    const auto path = (dir_ / name).string();
    write_whole(path, checkpoint.substr(32 + meta));
    torch::serialize::InputArchive in;
    const std::string error = ampx::test::error_text([&] { ampx::load_archive(in, path); });
    EXPECT_EQ(error.rfind("load_archive: '" + path + "'", 0), 0u) << name << ": " << error;
  }
}

}  // namespace
