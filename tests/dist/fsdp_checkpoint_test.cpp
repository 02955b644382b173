// FullyShardedDataParallel's and ZeRO-1's shard checkpoints on c10d/Gloo
// over loopback (tests/helpers/fsdp_worker.cpp): they resume on any number
// of ranks and under either wrapper, coded moments included; a missing,
// damaged or misplaced shard, or a load that fails on one rank alone, is
// refused on every rank, changing nothing.

#include <ampx/dist.h>
#include <ampx/fsdp.h>

#include "../rank_launch.h"
#include "fsdp_fixture.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

using ::testing::HasSubstr;

#ifdef AMPX_FSDP_WORKER

using ampx_test::FsdpTest;
using ampx_test::kParams;
using ampx_test::read_record;
using ampx_test::Record;

// Each rank saves its shard with AdamW's state of its pieces (ckpt-save,
// 2 ranks, before step 4); any number of ranks loads them. The state they
// rebuild is the saved one bit for bit (the full state at step 4); on 2
// ranks the 4 steps that follow are the uninterrupted run's bit for bit
// (moments, step counts and the loss scale restored), on 1 and 3 ranks
// within the rounding of another reduce order (fp32; measured 1.2e-7).
// A lost moment or a piece read from the wrong element moves a weight by
// about the learning rate (1e-2).
TEST_F(FsdpTest, ShardCheckpointsResumeOnAnyNumberOfRanks) {
  auto saved = run("ckpt-save", 2);
  const auto at4 = read_record(saved[0].out.string() + ".at4").params;
  const auto final_params = read_record(saved[0].out.string() + ".final").params;
  const auto steps = fsdp(saved[0]).steps;
  ASSERT_EQ(at4.size(), static_cast<size_t>(kParams));
  ASSERT_EQ(steps.size(), 8u);
  for (const int world : {2, 1, 3}) {
    auto resumed = run("ckpt-resume-from-2", world);
    const auto& out = resumed[0].out.string();
    EXPECT_EQ(read_record(out + ".at4").params, at4) << world << " ranks";
    const auto after = read_record(out + ".final").params;
    ASSERT_EQ(after.size(), final_params.size()) << world << " ranks";
    if (world == 2) {
      EXPECT_EQ(fsdp(resumed[0]).steps, std::vector<std::string>(steps.begin() + 4, steps.end()));
      EXPECT_EQ(after, final_params);
      continue;
    }
    float worst = 0.0f;
    for (size_t i = 0; i < after.size(); ++i) {
      worst = std::max(worst, std::abs(after[i] - final_params[i]));
    }
    EXPECT_LT(worst, 1e-4f) << world << " ranks";
  }
}

// ZeRO-1's shards (ZeroRedundancyOptimizer::save_shard) are FSDP's format:
// 2 ranks' shards at step 4 resume ZeRO-1 on 2 ranks bit for bit (the
// weights at step 4, the losses and scales of steps 4-7, the final
// weights), on 1 and 3 within 1e-4 (other reduce orders), and FSDP on 3;
// FSDP's shards resume ZeRO-1 on 2 and 3. A shard of another rank is
// refused on every rank, changing nothing.
TEST_F(FsdpTest, ZeroOneShardsResumeOnAnyNumberOfRanksAndAsFsdp) {
  auto saved = run("zero-ckpt-save", 2);
  const auto at4 = read_record(saved[0].out.string() + ".at4").params;
  const auto final_params = read_record(saved[0].out.string() + ".final").params;
  const auto steps = fsdp(saved[0]).steps;
  ASSERT_EQ(at4.size(), static_cast<size_t>(kParams));
  ASSERT_EQ(steps.size(), 8u);
  const auto close = [&](const std::vector<float>& got, const std::vector<float>& want,
                         const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    float worst = 0.0f;
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
    EXPECT_LT(worst, 1e-4f) << what;
  };
  for (const int world : {2, 1, 3}) {
    auto resumed = run("zero-ckpt-resume-from-2", world);
    const auto& out = resumed[0].out.string();
    const std::string what = "ZeRO-1 on " + std::to_string(world) + " ranks";
    EXPECT_EQ(read_record(out + ".at4").params, at4) << what;
    if (world == 2) {
      EXPECT_EQ(fsdp(resumed[0]).steps, std::vector<std::string>(steps.begin() + 4, steps.end()));
      EXPECT_EQ(read_record(out + ".final").params, final_params);
      continue;
    }
    close(read_record(out + ".final").params, final_params, what);
  }
  auto as_fsdp = run("ckpt-resume-from-zero-2", 3);
  EXPECT_EQ(read_record(as_fsdp[0].out.string() + ".at4").params, at4) << "FSDP on 3 ranks";
  close(read_record(as_fsdp[0].out.string() + ".final").params, final_params, "FSDP on 3 ranks");

  auto fsdp_saved = run("ckpt-save", 2);
  const auto fsdp_at4 = read_record(fsdp_saved[0].out.string() + ".at4").params;
  const auto fsdp_final = read_record(fsdp_saved[0].out.string() + ".final").params;
  for (const int world : {2, 3}) {
    auto resumed = run("zero-ckpt-resume-from-fsdp-2", world);
    const std::string what = "FSDP's shards in ZeRO-1 on " + std::to_string(world) + " ranks";
    EXPECT_EQ(read_record(resumed[0].out.string() + ".at4").params, fsdp_at4) << what;
    close(read_record(resumed[0].out.string() + ".final").params, fsdp_final, what);
  }

  const fs::path shards = dir_ / "zckpt-2";
  fs::copy_file(shards / "shard-0.pt", shards / "shard-1.pt", fs::copy_options::overwrite_existing);
  auto workers = ampx_test::run_ranks(AMPX_FSDP_WORKER, dir_, "zero-ckpt-resume-from-2", 2,
                                      std::chrono::seconds(120));
  for (const auto& w : workers) {
    EXPECT_EQ(w.status, 1) << w.output;
    EXPECT_THAT(w.output, HasSubstr("ZeroRedundancyOptimizer::load_shards: nothing was loaded: "
                                    "rank 0 failed: saved rank 1's shard was written by rank 0 "
                                    "of 2, not rank 1 of 2"));
    EXPECT_THAT(w.output, HasSubstr("unchanged 1"));
  }
}

// A shard file missing, truncated or of another rank: every rank refuses
// the load, naming the file (or the rank it was written by), and keeps its
// model as it was.
TEST_F(FsdpTest, AMissingDamagedOrMisplacedShardIsRefusedOnEveryRankChangingNothing) {
  run("ckpt-save", 2);
  const fs::path shards = dir_ / "ckpt-2";
  const auto keep = shards / "kept.pt";
  fs::copy_file(shards / "shard-1.pt", keep);
  const auto refused = [&](const std::string& expected) {
    auto workers = ampx_test::run_ranks(AMPX_FSDP_WORKER, dir_, "ckpt-resume-from-2", 2,
                                        std::chrono::seconds(120));
    for (const auto& w : workers) {
      EXPECT_EQ(w.status, 1) << w.output;
      EXPECT_THAT(w.output, HasSubstr("FullyShardedDataParallel::load_shards: nothing was "
                                      "loaded: rank 0 failed: "));
      EXPECT_THAT(w.output, HasSubstr(expected));
      EXPECT_THAT(w.output, HasSubstr("unchanged 1"));
    }
  };
  fs::remove(shards / "shard-1.pt");
  refused((shards / "shard-1.pt").string());
  fs::copy_file(keep, shards / "shard-1.pt");
  fs::resize_file(shards / "shard-1.pt", fs::file_size(keep) / 2);
  refused((shards / "shard-1.pt").string());
  fs::copy_file(shards / "shard-0.pt", shards / "shard-1.pt", fs::copy_options::overwrite_existing);
  refused("saved rank 1's shard was written by rank 0 of 2, not rank 1 of 2");
}

/// Sets an environment variable of the workers for a scope.
class WorkerEnv {
 public:
  WorkerEnv(const char* name, const std::string& value) : name_(name) {
    ::setenv(name, value.c_str(), 1);
  }
  ~WorkerEnv() { ::unsetenv(name_); }

 private:
  const char* name_;
};

/// The largest difference between two runs' final weights.
float worst_difference(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return INFINITY;
  float worst = 0.0f;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  return worst;
}

// Coded moments (bf16, FP8, 8-bit; blocks of 64, pieces of at least 256
// elements coded) travel in sharded checkpoints: on the ranks and pieces
// that saved them, the optimizer's own state resumes bit for bit (steps
// 4-7's losses and scales, the final weights); on 1 or 3 ranks, or under
// the other wrapper, the moments saved decoded are encoded again in the
// loader's blocks (a block's scale then comes from other elements, so a
// small moment's 8-bit or FP8 code moves by up to a few steps of the code):
// the final weights 4 steps later within 1e-2 of the uninterrupted run's
// for FP8 and 8-bit (measured 2.9e-3 to 4.6e-3), 1e-3 for bf16 (under
// 5e-4), where the moments shifted by one element on the way move them by
// 6e-2. An optimizer of another state format is refused on every rank,
// naming both formats.
TEST_F(FsdpTest, CodedMomentsResumeBitForBitOnTheSameRanksAndEncodedAgainOnOthers) {
  for (const std::string format : {"8bit", "fp8", "bf16"}) {
    WorkerEnv state("AMPX_FSDP_WORKER_STATE", format);
    for (const bool zero : {false, true}) {
      const std::string kind = zero ? "zero-" : "";
      auto saved = run(kind + "ckpt-save", 2);
      const auto final_params = read_record(saved[0].out.string() + ".final").params;
      const auto steps = fsdp(saved[0]).steps;
      ASSERT_EQ(steps.size(), 8u);
      auto same = run(kind + "ckpt-resume-from-2", 2);
      const std::string what = format + (zero ? " ZeRO-1" : " FSDP");
      EXPECT_EQ(fsdp(same[0]).steps, std::vector<std::string>(steps.begin() + 4, steps.end()))
          << what;
      EXPECT_EQ(read_record(same[0].out.string() + ".final").params, final_params) << what;
      const float bound = format == "bf16" ? 1e-3f : 1e-2f;
      const int other_world = zero ? 1 : 3;
      auto other = run(kind + "ckpt-resume-from-2", other_world);
      EXPECT_LT(
          worst_difference(read_record(other[0].out.string() + ".final").params, final_params),
          bound)
          << what << " on " << other_world << " ranks";
      if (!zero) continue;
      auto as_fsdp = run("ckpt-resume-from-zero-2", 3);
      EXPECT_LT(
          worst_difference(read_record(as_fsdp[0].out.string() + ".final").params, final_params),
          bound)
          << format << " ZeRO-1's shards under FSDP on 3 ranks";
    }
  }
  {
    WorkerEnv state("AMPX_FSDP_WORKER_STATE", "8bit");
    run("ckpt-save", 2);
  }
  WorkerEnv state("AMPX_FSDP_WORKER_STATE", "fp32");
  auto workers = ampx_test::run_ranks(AMPX_FSDP_WORKER, dir_, "ckpt-resume-from-2", 2,
                                      std::chrono::seconds(120));
  for (const auto& w : workers) {
    EXPECT_EQ(w.status, 1) << w.output;
    EXPECT_THAT(w.output, HasSubstr("FullyShardedDataParallel::load_shards: nothing was loaded: "
                                    "rank 0 failed: FullyShardedDataParallel::load_shards: the "
                                    "saved shards keep 8bit moments; this optimizer has "
                                    "state_format fp32"));
    EXPECT_THAT(w.output, HasSubstr("unchanged 1"));
  }
}

// A load that fails on one rank alone (here rank 1 cannot read the files)
// fails on every rank, naming that rank and its error, and rank 0, whose
// reading went well, keeps its model and optimizer as they were.
TEST_F(FsdpTest, ALoadThatFailsOnOneRankAloneIsRefusedOnEveryRank) {
  for (const std::string kind : {"", "zero-"}) {
    run(kind + "ckpt-save", 2);
    WorkerEnv fail("AMPX_FSDP_WORKER_FAIL_RANK", "1");
    auto workers = ampx_test::run_ranks(AMPX_FSDP_WORKER, dir_, kind + "ckpt-resume-from-2", 2,
                                        std::chrono::seconds(120));
    ASSERT_EQ(workers.size(), 2u);
    const std::string who = kind.empty() ? "FullyShardedDataParallel" : "ZeroRedundancyOptimizer";
    for (const auto& w : workers) {
      EXPECT_EQ(w.status, 1) << w.output;
      EXPECT_THAT(w.output, HasSubstr(who + "::load_shards: nothing was loaded: rank 1 failed: "
                                            "this rank cannot read shard 0"));
      EXPECT_THAT(w.output, HasSubstr("unchanged 1"));
    }
  }
}

#endif  // AMPX_FSDP_WORKER

}  // namespace
