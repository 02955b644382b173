// ZeroRedundancyOptimizer (ZeRO-1) on c10d/Gloo over loopback, 2 and 3
// worker processes (tests/helpers/dist_worker.cpp): sharded states give the
// unsharded parameters with less memory and resume bitwise, O2's sharded
// fp32 masters, param groups and global clipping, and the skip decision of
// an overflow on one rank.

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <ampx/zero.h>

#include "../rank_launch.h"
#include "dist_fixture.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

#ifdef AMPX_DIST_WORKER

using ampx_test::DistTest;
using ampx_test::max_abs_diff;

class ZeroTest : public DistTest, public ::testing::WithParamInterface<int> {
 protected:
  static int64_t state_bytes(const std::string& output, int which) {
    std::istringstream in(output.substr(output.find("state_bytes ") + 12));
    int64_t zero = 0, full = 0;
    in >> zero >> full;
    return which == 0 ? zero : full;
  }
};

TEST_P(ZeroTest, ShardedStatesGiveTheUnshardedParametersWithLessMemoryAndResumeBitwise) {
  const int world = GetParam();
  auto workers = run("zero", world);
  for (const auto& w : workers) ASSERT_EQ(w.status, 0) << w.output;
  const auto zero = params(workers[0].out), ddp = params(workers[0].out.string() + ".ref");
  ASSERT_EQ(zero.size(), 8u * 32 + 32 + 32 * 16 + 16 + 16 * 4 + 4);
  for (int r = 1; r < world; ++r) {
    EXPECT_EQ(params(workers[r].out), zero) << "rank " << r << " differs from rank 0";
  }
  // The same AdamW update on the same averaged fp32 gradients, elementwise:
  // only the order of the gradient sums may differ (world 3).
  EXPECT_LT(max_abs_diff(zero, ddp), 1e-6f);
  // And DDP with ampx's fused AdamW trains as one process on the global batch.
  torch::manual_seed(100);
  auto model =
      torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(), torch::nn::Linear(32, 16),
                            torch::nn::Tanh(), torch::nn::Linear(16, 4));
  ampx::optim::AdamW adamw(model->parameters(), ampx::optim::AdamWOptions(1e-2).weight_decay(0.01));
  torch::manual_seed(7);
  const auto x = torch::randn({12, 8}), y = torch::randn({12, 4});
  for (int step = 0; step < 20; ++step) {
    adamw.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    adamw.step();
  }
  std::vector<float> single;
  for (const auto& p : model->parameters()) {
    auto c = p.detach().contiguous();
    single.insert(single.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  EXPECT_LT(max_abs_diff(ddp, single), 1e-4f);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(params(workers[r].out.string() + ".resumed"), zero) << "rank " << r;
  }
  // Each rank holds exp_avg and exp_avg_sq (and the fp32 copy of its shard)
  // of 1/world of the parameters, plus at most world-1 elements of padding.
  const int64_t n = 8 * 32 + 32 + 32 * 16 + 16 + 16 * 4 + 4;
  const int64_t sharded = state_bytes(workers[0].output, 0),
                full = state_bytes(workers[0].output, 1);
  EXPECT_EQ(full, 2 * 4 * n);  // fp32 params: moments only
  EXPECT_EQ(sharded, 3 * 4 * ((n + world - 1) / world));
}

TEST_P(ZeroTest, O2KeepsShardedFp32MastersOfBf16WeightsAndFp32Norms) {
  const int world = GetParam();
  auto workers = run("zero-o2", world);
  for (const auto& w : workers) ASSERT_EQ(w.status, 0) << w.output;
  const auto zero = params(workers[0].out), ddp = params(workers[0].out.string() + ".ref");
  for (int r = 1; r < world; ++r) EXPECT_EQ(params(workers[r].out), zero) << "rank " << r;
  // DDP rounds the averaged bf16 gradients to bf16 (relative error 2^-9),
  // ZeRO averages them in fp32: the two runs move the weights from the same
  // start by the same amount, to within a few percent of that movement.
  torch::manual_seed(100);
  auto start = torch::nn::Sequential(
      torch::nn::Linear(8, 32), torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})),
      torch::nn::Tanh(), torch::nn::Linear(32, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
  std::vector<float> init;
  for (const auto& p : start->parameters()) {
    auto c = p.detach().to(torch::kBFloat16).to(torch::kFloat).contiguous();
    init.insert(init.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  double apart = 0, moved = 0;
  for (size_t i = 0; i < zero.size(); ++i) {
    apart += std::pow(zero[i] - ddp[i], 2);
    moved += std::pow(ddp[i] - init[i], 2);
  }
  EXPECT_GT(std::sqrt(moved), 0.5);
  EXPECT_LT(std::sqrt(apart / moved), 0.02)
      << "|zero - ddp| = " << std::sqrt(apart) << ", |ddp - start| = " << std::sqrt(moved);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(params(workers[r].out.string() + ".resumed"), zero) << "rank " << r;
  }
  // Unsharded O2: fp32 masters of the bf16 weights + 2 moments = 12 B per
  // element, 8 for the fp32 norm (its own master). Sharded: 12 B for each
  // element of this rank's shard of each dtype space (fp32 copy + moments).
  const int64_t sharded = state_bytes(workers[0].output, 0),
                full = state_bytes(workers[0].output, 1);
  const int64_t n16 = 8 * 32 + 32 + 32 * 16 + 16 + 16 * 4 + 4, n32 = 2 * 32;
  EXPECT_EQ(full, 12 * n16 + 8 * n32);
  auto ceil_div = [world](int64_t n) { return (n + world - 1) / world; };
  EXPECT_EQ(sharded, 12 * (ceil_div(n16) + ceil_div(n32)));
  EXPECT_LT(sharded, full / world + 12 * n32);  // the fp32 norm's copy: the only overhead
}

TEST_P(ZeroTest, ParamGroupsAndGlobalClippingGiveTheUnshardedParameters) {
  const int world = GetParam();
  auto workers = run("zero-groups", world);
  for (const auto& w : workers) ASSERT_EQ(w.status, 0) << w.output;
  const auto zero = params(workers[0].out), ddp = params(workers[0].out.string() + ".ref");
  for (int r = 1; r < world; ++r) EXPECT_EQ(params(workers[r].out), zero) << "rank " << r;
  // Per-group lr and decay and the clip by the norm of the whole averaged
  // gradient, as one unsharded optimizer does them.
  EXPECT_LT(max_abs_diff(zero, ddp), 1e-6f);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(params(workers[r].out.string() + ".resumed"), zero) << "rank " << r;
  }
  // ZeRO's norm is the global one (not its shard's), and the clip was active.
  std::istringstream norms(text(workers[0].out.string() + ".norms"));
  double zero_norm = 0, full_norm = 0;
  int steps = 0, clipped = 0;
  while (norms >> zero_norm >> full_norm) {
    ++steps;
    EXPECT_NEAR(zero_norm, full_norm, 1e-5 * full_norm) << "step " << steps;
    clipped += full_norm > 0.05;
  }
  EXPECT_EQ(steps, 20);
  EXPECT_GE(clipped, 10);
}

INSTANTIATE_TEST_SUITE_P(World, ZeroTest, ::testing::Values(2, 3));

TEST_F(DistTest, ZeroOverflowOnOneRankSkipsEverywhereWithSynchronizedScalers) {
  auto workers = run("zero-overflow", 2);
  for (const auto& w : workers) ASSERT_EQ(w.status, 0) << w.output;
  const std::string la = text(workers[0].out), lb = text(workers[1].out);
  EXPECT_EQ(la, lb) << "ranks disagree on scale or skipping";
  EXPECT_THAT(la, HasSubstr("2 1024 1\n3 512 0\n4 512 1\n"));
}

TEST_F(DistTest, ZeroWithoutSynchronizedScalersSaysSoInsteadOfDiverging) {
  auto workers = run("zero-unsynced", 2);
  EXPECT_EQ(workers[0].status, 1);
  EXPECT_EQ(workers[1].status, 1);
  EXPECT_THAT(workers[0].output,
              HasSubstr("ZeroRedundancyOptimizer: rank 0's GradScaler found no inf/NaN "
                        "but another rank's did; make the scalers agree with "
                        "ampx::dist::synchronize_found_inf(scaler, group)"));
  // Rank 1 says the converse, or, when rank 0 has already exited, that the
  // collective failed.
  const auto& out1 = workers[1].output;
  EXPECT_THAT(out1, AnyOf(HasSubstr("rank 1's GradScaler found an inf/NaN but another rank's "
                                    "did not"),
                          HasSubstr("failed on rank 1 of 2")));
}

#endif  // AMPX_DIST_WORKER

}  // namespace
