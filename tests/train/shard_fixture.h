#pragma once

// The fixture of ampx-train's sharding tests (shard_test.cpp,
// shard_fp8_test.cpp): tiny gpt runs of 2 ranks under each --shard and DDP,
// their results, weights checksums and checkpoints.

#include "test_support.h"

#include <ampx/dist.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#ifdef AMPX_TRAIN_BINARY

namespace ampx::train::test {

/// What one run gave: its result file, and each rank's weights checksum.
struct ShardRun {
  nlohmann::json result;
  std::vector<std::string> weights;  // "0x...", in the order the ranks printed
  std::string output;
};

/// An int from the environment (`make test-shard-long` sets them), else `fallback`.
inline int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

class ShardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!ampx::dist::is_available()) GTEST_SKIP() << "ampx built without c10d/Gloo";
    ampx::train::test::write_text_data(tmp_.path() / "data", "abcdefgh ", 20000, 3);
  }

  /// A tiny gpt run's flags; `more` adds to them or overrides them, and
  /// its --out-dir (default <tmp>/<workload>-<shard>-<mode>) names the run.
  std::vector<std::string> flags(
      const std::string& workload, const std::string& shard, const std::string& mode,
      const std::vector<std::pair<std::string, std::string>>& more = {}) {
    const std::string name = run_name(workload, shard, mode, more);
    std::vector<std::pair<std::string, std::string>> all = {
        {"--workload", workload},
        {"--layers", "2"},
        {"--d-model", "32"},
        {"--batch-size", std::to_string(4 * ranks_)},
        {"--steps", std::to_string(steps_)},
        {"--nproc", std::to_string(ranks_)},
        {"--shard", shard},
        {"--precision", mode},
        {"--data-dir", (tmp_.path() / "data").string()},
        {"--out-dir", (tmp_.path() / name).string()},
        {"--result-file", (tmp_.path() / (name + ".json")).string()}};
    all.insert(all.end(), more.begin(), more.end());
    return ampx::train::test::tiny_gpt(all);
  }

  static std::string run_name(const std::string& workload, const std::string& shard,
                              const std::string& mode,
                              const std::vector<std::pair<std::string, std::string>>& more) {
    for (const auto& [flag, value] : more) {
      if (flag == "--out-dir") return std::filesystem::path(value).filename().string();
    }
    return workload + "-" + shard + "-" + mode;
  }

  ShardRun run(const std::string& workload, const std::string& shard, const std::string& mode,
               const std::vector<std::pair<std::string, std::string>>& more = {},
               int expected_status = 0) {
    const std::string name = run_name(workload, shard, mode, more);
    const auto exit = ampx::train::test::run_train(flags(workload, shard, mode, more),
                                                   tmp_.path() / (name + ".log"));
    ShardRun r;
    r.output = exit.output;
    EXPECT_EQ(exit.status, expected_status) << name << ": " << exit.output;
    std::ifstream in(tmp_.path() / (name + ".json"));
    if (in) r.result = nlohmann::json::parse(in);
    static const std::regex re(R"(rank \d+ of \d+: weights (0x[0-9a-f]+))");
    for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), re);
         it != std::sregex_iterator(); ++it) {
      r.weights.push_back((*it)[1].str());
    }
    return r;
  }

  /// Run `name`'s metrics of mode `mode` (its --out-dir is <tmp>/<name>).
  ampx::train::test::Metrics metrics_of(const std::string& name, const std::string& mode) const {
    return ampx::train::test::read_metrics(tmp_.path() / name / ("metrics-" + mode + ".jsonl"));
  }

  /// Run `name`'s checkpoint folder.
  std::filesystem::path ck(const std::string& name) const { return tmp_.path() / (name + "-ck"); }

  /// fp32 gpt run `name` under `shard` on `nproc` ranks to step `steps`,
  /// saving every 4 steps into ck(name), resuming it if `resume`; `extra`
  /// flags last.
  ShardRun train(const std::string& name, const std::string& shard, int nproc, int steps,
                 bool resume, int expected_status = 0,
                 const std::vector<std::pair<std::string, std::string>>& extra = {}) {
    std::vector<std::pair<std::string, std::string>> more = {
        {"--out-dir", (tmp_.path() / name).string()},
        {"--result-file", (tmp_.path() / (name + ".json")).string()},
        {"--checkpoint-dir", ck(name).string()},
        {"--nproc", std::to_string(nproc)},
        {"--steps", std::to_string(steps)},
        {"--save-every", "4"}};
    more.insert(more.end(), extra.begin(), extra.end());
    auto args = flags("gpt", shard, "fp32", more);
    if (resume) args.push_back("--resume");
    const auto exit = ampx::train::test::run_train(args, tmp_.path() / (name + ".log"));
    EXPECT_EQ(exit.status, expected_status) << name << ": " << exit.output;
    std::ifstream in(tmp_.path() / (name + ".json"));
    ShardRun r;
    r.output = exit.output;
    if (in && expected_status == 0) r.result = nlohmann::json::parse(in);
    return r;
  }

  /// The largest relative difference of a's losses from b's (inf: other lengths).
  static double near(const std::vector<double>& a, const std::vector<double>& b) {
    double worst = a.size() == b.size() ? 0.0 : INFINITY;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      worst = std::max(worst, std::abs(a[i] - b[i]) / std::abs(b[i]));
    }
    return worst;
  }

  TempDir tmp_{"ampx-shard"};
  // The runs' ranks and steps: 2 and 20 in `make test`; `make test-shard-long`
  // runs the O2 test with more.
  const int ranks_ = env_int("AMPX_SHARD_TEST_RANKS", 2);
  const int steps_ = env_int("AMPX_SHARD_TEST_STEPS", 20);
};

inline std::vector<double> losses(const ShardRun& r) {
  return r.result.value("losses", std::vector<double>{});
}

/// The bytes of the file at `path` ("" if there is none).
inline std::string bytes_of(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace ampx::train::test

#endif  // AMPX_TRAIN_BINARY
