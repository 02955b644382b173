#pragma once

// What safetensors_test.cpp and safetensors_fp8_test.cpp share: a test's
// own folder, and files written byte by byte.

#include "ampx/safetensors.h"

#include "../error_text.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace ampx {
namespace test {

namespace fs = std::filesystem;

/// A folder of its own per test, removed after it.
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
    return error_text([&] { ampx::read_safetensors(p); });
  }
  static std::string contents_error_of(const std::string& p) {
    return error_text([&] { ampx::read_safetensors_contents(p); });
  }

  fs::path dir_;
};

}  // namespace test
}  // namespace ampx
