#pragma once

// What checkpoint_test.cpp and checkpoint_resume_test.cpp share:
// TrainCheckpointTest, a checkpoint path in a temporary folder, and the
// sample description and payload written there.

#include "run/checkpoint.h"
#include "test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace ampx::train::test {

/// Every byte value, twice, in two orders: NULs, high bits, CR/LF all survive.
inline std::string all_byte_values() {
  std::string s;
  for (int i = 0; i < 256; ++i) s.push_back(static_cast<char>(i));
  for (int i = 255; i >= 0; --i) s.push_back(static_cast<char>(i));
  return s;
}

/// A description with nesting, floats and a string that needs escaping.
inline nlohmann::json sample_meta() {
  return {{"format", "ampx-train checkpoint"},
          {"step", 7},
          {"run", {{"workload", "gpt"}, {"precision", "O2"}, {"dtype", "bf16"}, {"lr", 0.001}}},
          {"losses", {4.25, 3.5, 0.1}},
          {"note", "caf\u00e9 \"quoted\" \\ \n"}};
}

/// A checkpoint path in a fresh temporary folder (removed after the test)
/// whose name has a space and a quote.
class TrainCheckpointTest : public testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ampx-checkpoint-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    // A folder name with a space and a quote: the messages must show it as is.
    run_dir_ = dir_ / "run 'a'";
    fs::create_directories(run_dir_);
    path_ = run_dir_ / "checkpoint.ampx";
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  /// Writes a good checkpoint at path_ and returns its bytes.
  std::string write_good() {
    ampx::train::write_checkpoint(path_, sample_meta(), all_byte_values());
    return read_bytes(path_);
  }

  /// Puts `bytes` at path_, reads it, checks the file was left byte for byte
  /// as it was, and returns the error text ("" if the read succeeded).
  std::string read_error(const std::string& bytes) {
    write_bytes(path_, bytes);
    const std::string text = error_text([&] { ampx::train::read_checkpoint(path_); });
    EXPECT_EQ(read_bytes(path_), bytes) << "a failed read changed " << path_;
    return text;
  }

  /// "ampx-train: checkpoint '<path_>'", the start of most messages.
  std::string where() const { return "ampx-train: checkpoint '" + path_.string() + "'"; }

  fs::path dir_, run_dir_, path_;
};

}  // namespace ampx::train::test
