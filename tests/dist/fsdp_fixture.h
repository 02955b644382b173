#pragma once

// What fsdp_test.cpp and fsdp_checkpoint_test.cpp share: FsdpTest, which
// starts tests/helpers/fsdp_worker.cpp's ranks, and the records they write.

#include "../rank_launch.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#ifdef AMPX_FSDP_WORKER

namespace ampx_test {

namespace fs = std::filesystem;

// The residual MLP's parameters (8x32 input layer, two blocks of d 32 with a
// LayerNorm and a 4x MLP, the root's LayerNorm, a 32x4 head).
constexpr int64_t kParams =
    (8 * 32 + 32) + 2 * (2 * 32 + 32 * 128 + 128 + 128 * 32 + 32) + 2 * 32 + (32 * 4 + 4);

/// One run's record: a line per step and rank 0's final parameters.
struct Record {
  std::vector<std::string> steps;  // "loss <step> <loss> <scale> <stepped>"
  std::vector<double> losses, norms;
  std::vector<float> params;
};

inline Record read_record(const fs::path& path) {
  Record r;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string kind, a, b;
    fields >> kind;
    if (kind == "loss") {
      r.steps.push_back(line);
      fields >> a >> b;
      r.losses.push_back(std::strtod(b.c_str(), nullptr));
    } else if (kind == "norm") {
      fields >> a;
      r.norms.push_back(std::strtod(a.c_str(), nullptr));
    } else if (kind == "param") {
      fields >> a;
      r.params.push_back(std::strtof(a.c_str(), nullptr));
    }
  }
  return r;
}

/// A number the worker printed: "<name> <value>".
inline int64_t printed(const std::string& output, const std::string& name) {
  const auto at = output.find(name + " ");
  if (at == std::string::npos) return -1;
  return std::stoll(output.substr(at + name.size() + 1));
}

class FsdpTest : public ::testing::Test {
 protected:
  std::vector<ampx_test::Worker> run(const std::string& scenario, int world) {
    auto workers = ampx_test::run_ranks(AMPX_FSDP_WORKER, dir_, scenario, world);
    for (const auto& w : workers) EXPECT_EQ(w.status, 0) << scenario << ": " << w.output;
    return workers;
  }

  static Record ddp(const ampx_test::Worker& w) { return read_record(w.out.string() + ".ddp"); }
  static Record fsdp(const ampx_test::Worker& w) { return read_record(w.out.string() + ".fsdp"); }

  ampx_test::TempFolder tmp_{"ampx-fsdp"};
  fs::path dir_ = tmp_.path();
};

}  // namespace ampx_test

#endif  // AMPX_FSDP_WORKER
