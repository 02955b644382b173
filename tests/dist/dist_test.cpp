// Data-parallel training on c10d/Gloo over loopback: 2 and 3 worker
// processes (tests/helpers/dist_worker.cpp) started with torchrun's variables. Each
// test is bounded in time and ends its workers itself. ZeRO-1: zero_test.cpp.

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <ampx/zero.h>

#include "../rank_launch.h"
#include "dist_fixture.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace fs = std::filesystem;

namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

#ifdef AMPX_DIST_WORKER

using ampx_test::DistTest;
using ampx_test::gloo_sums;
using ampx_test::max_abs_diff;
using ampx_test::refusal;

class DistWorldTest : public DistTest, public ::testing::WithParamInterface<int> {};

TEST_P(DistWorldTest, RanksEndBitwiseIdenticalAndMatchSingleProcessTraining) {
  const int world = GetParam();
  auto workers = run("train", world);
  for (const auto& w : workers) ASSERT_EQ(w.status, 0) << w.output;
  const auto rank0 = params(workers[0].out);
  ASSERT_EQ(rank0.size(), 8u * 32 + 32 + 32 * 16 + 16 + 16 * 4 + 4);
  for (int r = 1; r < world; ++r) {
    EXPECT_EQ(params(workers[r].out), rank0) << "rank " << r << " differs from rank 0";
  }
  const auto reference = single_process_reference();
  EXPECT_LT(max_abs_diff(rank0, reference), 1e-5f);
  // Without the broadcast and the all-reduce, each rank would have its own
  // weights: rank 1 started from other random values.
  torch::manual_seed(101);
  auto other = torch::nn::Linear(8, 32);
  EXPECT_GT(std::abs(other->weight[0][0].item<float>() - rank0[0]), 1e-3f);
}

// Activation checkpointing under DDP: the checkpointed layers' gradients
// arrive in the recompute's backward, inside the step's; DDP's hooks reduce
// them as any others, and the ranks end with the plain run's weights, bit
// for bit.
TEST_F(DistTest, CheckpointedLayersTrainAsThePlainOnesBitForBit) {
  const auto plain = run("train", 2), checkpointed = run("checkpointed", 2);
  for (const auto* workers : {&plain, &checkpointed}) {
    for (const auto& w : *workers) ASSERT_EQ(w.status, 0) << w.output;
  }
  const auto want = params(plain[0].out);
  ASSERT_FALSE(want.empty());
  for (int r = 0; r < 2; ++r) EXPECT_EQ(params(checkpointed[r].out), want) << "rank " << r;
}

TEST_P(DistWorldTest, NoSyncAccumulationEqualsOneFullStep) {
  const int world = GetParam();
  auto workers = run("accumulate", world);
  for (const auto& w : workers) ASSERT_EQ(w.status, 0) << w.output;
  const auto rank0 = params(workers[0].out);
  for (int r = 1; r < world; ++r) EXPECT_EQ(params(workers[r].out), rank0);
  EXPECT_LT(max_abs_diff(rank0, single_process_reference()), 1e-5f);
}

TEST_P(DistWorldTest, RanksGivenDifferentModelsAllFailAtConstructionNamingTheDifference) {
  const int world = GetParam();
  const std::string others = world == 2 ? "0" : "0, 1", last = std::to_string(world - 1);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"mismatch-shape", "parameter '4.weight' is Float [4, 16] on cpu on rank(s) " + others +
                             " but Float [5, 16] on cpu on rank(s) " + last +
                             "; parameter '4.bias' is Float [4] on cpu on rank(s) " + others +
                             " but Float [5] on cpu on rank(s) " + last + " (this is rank "},
      {"mismatch-count", "parameter '5.weight' is absent on rank(s) " + others +
                             " but Float [4, 4] on cpu on rank(s) " + last},
      {"mismatch-dtype", "parameter '0.weight' is Float [32, 8] on cpu on rank(s) " + others +
                             " but BFloat16 [32, 8] on cpu on rank(s) " + last},
      {"mismatch-options", "option bucket_cap_bytes is 512 on rank(s) " + others +
                               " but 1024 on rank(s) " + last + " (this is rank "},
  };
  for (const auto& [scenario, expected] : cases) {
    const auto start = std::chrono::steady_clock::now();
    auto workers = run(scenario, world, std::chrono::seconds(90));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (int r = 0; r < world; ++r) {
      const auto& w = workers[r];
      EXPECT_EQ(w.status, 1) << scenario << ", rank " << r << ":\n" << w.output;
      EXPECT_THAT(w.output,
                  HasSubstr("DistributedDataParallel: the ranks were given different models or "
                            "options"))
          << scenario << ", rank " << r;
      EXPECT_THAT(w.output, HasSubstr(expected)) << scenario << ", rank " << r;
      EXPECT_THAT(w.output, HasSubstr("(this is rank " + std::to_string(r) + " of " +
                                      std::to_string(world) + ")"))
          << scenario;
    }
    // At construction, not after a collective's timeout (60 s).
    EXPECT_LT(seconds, 30.0) << scenario;
  }
}

INSTANTIATE_TEST_SUITE_P(World, DistWorldTest, ::testing::Values(2, 3));

TEST_F(DistTest, OverflowOnOneRankSkipsAndBacksOffOnEveryRank) {
  auto workers = run("overflow", 2);
  for (const auto& w : workers) ASSERT_EQ(w.status, 0) << w.output;
  const std::string la = text(workers[0].out), lb = text(workers[1].out);
  EXPECT_EQ(la, lb) << "ranks disagree on scale or skipping";
  // Step 3 (rank 1's inf) skipped everywhere and halved the scale 1024 -> 512.
  EXPECT_THAT(la, HasSubstr("2 1024 1\n3 512 0\n4 512 1\n"));
}

TEST_F(DistTest, NonFiniteGuardUnderDdpLeavesTrainingBitwiseAndFindsTheRankThatOverflowed) {
  // Clean training: the guard finds nothing and changes no bit.
  auto plain = run("train", 2);
  auto guarded = run("guarded-train", 2);
  for (const auto& w : plain) ASSERT_EQ(w.status, 0) << w.output;
  for (const auto& w : guarded) ASSERT_EQ(w.status, 0) << w.output;
  EXPECT_EQ(params(guarded[0].out), params(plain[0].out));
  EXPECT_THAT(guarded[0].output, HasSubstr("nonfinite 0"));
  // Rank 1's loss overflows in a multiplication at step 3: its guard names
  // that op as the creator; rank 0 first sees the inf arrive through the
  // all-reduce (a propagated value, in DDP's averaging of the buckets).
  auto overflow = run("guarded-overflow-op", 2);
  for (const auto& w : overflow) ASSERT_EQ(w.status, 0) << w.output;
  EXPECT_THAT(overflow[1].output, HasSubstr("first aten::mul forward step 3 created"));
  EXPECT_THAT(overflow[0].output, HasSubstr(" step 3 propagated"));
  EXPECT_EQ(text(overflow[0].out), text(overflow[1].out));  // both skipped step 3
}

TEST_F(DistTest, CompressedCommunicationHalvesTheBytesWithinStatedError) {
  // (dist_worker's "compressed": float16 on 1.13, bfloat16 on 2.x)
  const auto type =
      std::string(ampx::torch_version()).rfind("1.", 0) == 0 ? at::kHalf : at::kBFloat16;
  if (!gloo_sums(type)) {
    GTEST_SKIP() << "this LibTorch's Gloo cannot sum " << type
                 << "; the refusal is Bf16CommunicationWorksOrSaysWhyAtConstruction's";
  }
  auto fp32 = run("train", 2);
  auto bf16 = run("compressed", 2);
  for (const auto& w : fp32) ASSERT_EQ(w.status, 0) << w.output;
  for (const auto& w : bf16) ASSERT_EQ(w.status, 0) << w.output;
  auto bytes = [](const std::string& output) {
    return std::stoll(output.substr(output.rfind("bytes ") + 6));
  };
  EXPECT_EQ(bytes(bf16[0].output) * 2, bytes(fp32[0].output));
  const auto a = params(fp32[0].out), b = params(bf16[0].out);
  EXPECT_EQ(params(bf16[1].out), b);  // still identical across ranks
  // bf16 (2.x) keeps 8 significant bits, fp16 (1.13's Gloo) 11: 20 SGD steps
  // stay within 1e-2 of fp32 communication.
  EXPECT_LT(max_abs_diff(a, b), 1e-2f);
  EXPECT_GT(max_abs_diff(a, b), 0.0f);  // and the compression was real
}

// Values of the reduced gradients, against the mean of the ranks' fp32
// gradients computed in this process. fp32: summation order only. fp16 and
// bf16: each rank's gradient and the sum are rounded to nearest (half an ulp:
// 2^-11 and 2^-8 relative), so the error stays within 2^-9 and 2^-6 of the
// ranks' largest magnitude; and some elements must differ from the fp32
// mean, or nothing was compressed.
TEST_F(DistTest, ReducedGradientsAreTheRanksMeanInFp32) {
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    expect_mean_gradients("grads-fp32", world, 1e-5f);
  }
}

TEST_F(DistTest, Fp16CommunicationGivesTheMeanWithinFp16RoundingOrSaysWhy) {
  if (!gloo_sums(at::kHalf)) {  // Debian's 2.14
    for (const auto& w : run("grads-fp16", 2)) {
      EXPECT_EQ(w.status, 1);
      EXPECT_THAT(w.output, HasSubstr(refusal(at::kHalf)));
    }
    return;
  }
  EXPECT_GT(expect_mean_gradients("grads-fp16", 2, 1.f / 512), 0);
}

// fp16 parameters' gradients of 40000 on both ranks: their sum (80000) is
// past fp16's largest, their mean is not. DDP divides fp16 sums by 2 before
// the all-reduce on 2 ranks (FSDP's rule, PyTorch DDP's order), or widens
// them to float32 where Gloo cannot sum fp16 (Debian's 2.14): the mean,
// exactly, in fp16, on every rank; not inf.
TEST_F(DistTest, Fp16GradientsWhoseSumOverflowsAverageToTheirFiniteMean) {
  auto workers = run("fp16-sum", 2);
  for (const auto& w : workers) {
    ASSERT_EQ(w.status, 0) << w.output;
    EXPECT_EQ(params(w.out), std::vector<float>(8, 40000.f));
  }
}

TEST_F(DistTest, Bf16CommunicationWorksOrSaysWhyAtConstruction) {
  if (!gloo_sums(at::kBFloat16)) {  // 1.13 ("use torch::kHalf"), Debian's 2.14
    auto workers = run("bf16-probe", 2);
    for (const auto& w : workers) {
      EXPECT_EQ(w.status, 1);
      EXPECT_THAT(w.output, HasSubstr(refusal(at::kBFloat16)));
    }
    return;
  }
  auto workers = run("bf16-probe", 2);
  for (const auto& w : workers) EXPECT_EQ(w.status, 0) << w.output;
  // Trained 20 steps in bf16 communication: identical ranks, near fp32.
  const auto trained = params(workers[0].out);
  EXPECT_EQ(params(workers[1].out), trained);
  EXPECT_LT(max_abs_diff(trained, single_process_reference()), 1e-2f);
  EXPECT_GT(expect_mean_gradients("grads-bf16", 2, 1.f / 64), 0);
}

TEST_F(DistTest, AKilledRankMakesTheOthersFailWithinTheTimeout) {
  const auto start = std::chrono::steady_clock::now();
  auto workers = run("kill", 2, std::chrono::seconds(60));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(workers[1].status, 3);
  EXPECT_EQ(workers[0].status, 1) << workers[0].output;
  EXPECT_THAT(workers[0].output,
              HasSubstr("ampx::dist: gradient all-reduce failed on rank 0 of 2"));
  EXPECT_LT(seconds, 30.0);
}

TEST_F(DistTest, BucketsLaunchInTheSameOrderOnEveryRankWhateverFillsFirst) {
  auto workers = run("unused-order", 2);
  for (const auto& w : workers) ASSERT_EQ(w.status, 0) << w.output;
  // Rank 0's gradient of the first branch and rank 1's of the second, each
  // averaged with the other rank's zeros.
  torch::manual_seed(5);
  torch::nn::Linear a(8, 4), b(8, 4);
  std::vector<float> expected;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(6 + r);
    const auto x = torch::randn({3, 8}), y = torch::randn({3, 4});
    torch::mse_loss(r == 0 ? a->forward(x) : b->forward(x), y).backward();
  }
  for (const auto& p : {a->weight, a->bias, b->weight, b->bias}) {
    auto g = (p.grad() * 0.5).contiguous();
    expected.insert(expected.end(), g.data_ptr<float>(), g.data_ptr<float>() + g.numel());
  }
  const auto rank0 = params(workers[0].out);
  EXPECT_EQ(params(workers[1].out), rank0);
  EXPECT_LT(max_abs_diff(rank0, expected), 1e-7f);
}

// TE's reduce_amax: with the group, every rank's FP8 states hold the max over
// the ranks of each step's amax, so ranks stay bitwise identical; without it
// each rank's own. The first layer's input is the data, whatever the
// weights: its reduced history is the element-wise max of the local ones.
TEST_F(DistTest, Fp8AmaxReductionKeepsScalingStatesBitwiseIdenticalAcrossRanks) {
  constexpr size_t kParams = 8 * 32 + 32 + 32 * 16 + 16 + 16 * 4 + 4;
  // Buffers per layer: 3 roles x (history 4 + scale 1 + scale_inv 1).
  constexpr size_t kBuffers = 3 * 3 * 6;
  auto reduced = run("fp8", 2);
  for (const auto& w : reduced) ASSERT_EQ(w.status, 0) << w.output;
  const auto r0 = params(reduced[0].out), r1 = params(reduced[1].out);
  ASSERT_EQ(r0.size(), kParams + kBuffers);
  EXPECT_EQ(r0, r1) << "with amax reduction the ranks must agree bitwise, states included";

  auto local = run("fp8-local", 2);
  for (const auto& w : local) ASSERT_EQ(w.status, 0) << w.output;
  const auto l0 = params(local[0].out), l1 = params(local[1].out);
  ASSERT_EQ(l0.size(), r0.size());
  EXPECT_NE(std::vector<float>(l0.begin() + kParams, l0.end()),
            std::vector<float>(l1.begin() + kParams, l1.end()))
      << "the ranks' shards differ, so their own amaxes must too";
  // named_buffers order: layer 0's input_amax_history comes first.
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(r0[kParams + i], std::max(l0[kParams + i], l1[kParams + i])) << "history slot " << i;
  }
  EXPECT_GT(r0[kParams + 3], 0.f);
}

// The plan watch over ranks whose gradients and thresholds differ (rank 0
// at the least-squares optimum, where NVFP4's gradient is noise; rank 1 far
// from it, with a noise ratio that never reports): with WatchOptions::group
// every rank reports and moves the layer on rank 0's numbers and decision,
// so the ranks keep training one plan; without it rank 1 keeps NVFP4 while
// rank 0 moves the layer to MXFP8.
TEST_F(DistTest, PlanWatchDecidesOnRankZerosNumbersOnEveryRank) {
  auto agreed = run("plan-watch", 2);
  for (const auto& w : agreed) ASSERT_EQ(w.status, 0) << w.output;
  const auto a0 = text(agreed[0].out), a1 = text(agreed[1].out);
  EXPECT_THAT(a0, HasSubstr("fc gradient below noise "));
  EXPECT_THAT(a0, HasSubstr("fc in mxfp8"));
  EXPECT_EQ(a1, a0);

  auto alone = run("plan-watch-alone", 2);
  for (const auto& w : alone) ASSERT_EQ(w.status, 0) << w.output;
  EXPECT_EQ(text(alone[0].out), a0) << "rank 0's own numbers are the ones broadcast";
  EXPECT_EQ(text(alone[1].out), "fc in nvfp4\n");
}

#endif  // AMPX_DIST_WORKER

}  // namespace
