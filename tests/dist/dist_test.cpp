// Data-parallel training on c10d/Gloo over loopback: 2 and 3 worker
// processes (tests/helpers/dist_worker.cpp) started with torchrun's variables. Each
// test is bounded in time and ends its workers itself.

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <ampx/zero.h>

#include "../rank_launch.h"

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

// Whether this LibTorch's Gloo sums `type`, found as DistributedDataParallel
// finds it: a one-element all-reduce, here in a group of one. Builds differ:
// 1.13's sums float16 only, Debian's 2.6 both 16-bit floats, Debian's 2.14
// neither ("Gloo: Invalid scalar type").
bool gloo_sums(at::ScalarType type) {
  ampx::dist::LaunchEnv env;
  env.master_addr = "127.0.0.1";
  env.master_port = ampx::dist::free_loopback_port();
  auto pg = ampx::dist::init_process_group(
      env, ampx::dist::InitOptions().timeout(std::chrono::seconds(60)).nccl(false));
  auto t = torch::ones({1}, type);
  try {
    pg.all_reduce_sum(t);
  } catch (const c10::Error&) {
    return false;
  }
  return true;
}

// What DistributedDataParallel says at construction when the leg's Gloo
// cannot sum `type` as communication_dtype.
std::string refusal(at::ScalarType type) {
  const auto other = type == at::kBFloat16 ? at::kHalf : at::kBFloat16;
  return std::string("DistributedDataParallel: this LibTorch's Gloo cannot all-reduce ") +
         c10::toString(type) + " gradients (communication_dtype); use " +
         (gloo_sums(other) ? std::string("torch::k") + c10::toString(other) + " or float32"
                           : std::string("float32 (it cannot sum Half or BFloat16)"));
}

using ampx_test::Worker;

class DistTest : public ::testing::Test {
 protected:
  /// Starts `world` workers of `scenario` and waits (at most `limit`) for all.
  std::vector<Worker> run(const std::string& scenario, int world,
                          std::chrono::seconds limit = std::chrono::seconds(120)) {
    return ampx_test::run_ranks(AMPX_DIST_WORKER, dir_, scenario, world, limit);
  }

  static std::string text(const fs::path& p) {
    std::ifstream in(p);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  static std::vector<float> params(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::vector<float> v;
    float x;
    while (in.read(reinterpret_cast<char*>(&x), sizeof(x))) v.push_back(x);
    return v;
  }

  /// The workers' model trained in one process on the whole global batch.
  static std::vector<float> single_process_reference() {
    torch::manual_seed(100);
    auto model = torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(),
                                       torch::nn::Linear(32, 16), torch::nn::Tanh(),
                                       torch::nn::Linear(16, 4));
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    torch::manual_seed(7);
    const auto x = torch::randn({12, 8}), y = torch::randn({12, 4});
    for (int step = 0; step < 20; ++step) {
      opt.zero_grad();
      torch::mse_loss(model->forward(x), y).backward();
      opt.step();
    }
    std::vector<float> v;
    for (const auto& p : model->parameters()) {
      auto c = p.detach().contiguous();
      v.insert(v.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
    }
    return v;
  }

  /// Each rank's fp32 gradients of one backward on its shard, computed here
  /// with rank 0's model as the workers' "grads-*" scenarios have it.
  static std::vector<std::vector<float>> rank_gradients(int world) {
    torch::manual_seed(7);
    const auto x = torch::randn({12, 8}), y = torch::randn({12, 4});
    const int64_t shard = 12 / world;
    std::vector<std::vector<float>> out;
    for (int r = 0; r < world; ++r) {
      torch::manual_seed(100);
      auto model = torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(),
                                         torch::nn::Linear(32, 16), torch::nn::Tanh(),
                                         torch::nn::Linear(16, 4));
      torch::mse_loss(model->forward(x.slice(0, r * shard, (r + 1) * shard)),
                      y.slice(0, r * shard, (r + 1) * shard))
          .backward();
      std::vector<float> g;
      for (const auto& p : model->parameters()) {
        auto c = p.grad().contiguous();
        g.insert(g.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
      }
      out.push_back(std::move(g));
    }
    return out;
  }

  /// Runs `scenario` ("grads-fp32/fp16/bf16") on `world` ranks and checks that
  /// every rank holds the mean of the ranks' gradients, each element within
  /// `rel` times the largest rank's magnitude of that element (plus 1e-7),
  /// and that the ranks agree bitwise. Returns how many elements differ from
  /// the fp32 mean at all.
  int64_t expect_mean_gradients(const std::string& scenario, int world, float rel) {
    auto workers = run(scenario, world);
    for (const auto& w : workers) EXPECT_EQ(w.status, 0) << w.output;
    const auto ranks = rank_gradients(world);
    std::vector<float> mean(ranks[0].size(), 0.f), scale(ranks[0].size(), 0.f);
    for (size_t i = 0; i < mean.size(); ++i) {
      double sum = 0;
      for (const auto& g : ranks) {
        sum += g[i];
        scale[i] = std::max(scale[i], std::abs(g[i]));
      }
      mean[i] = static_cast<float>(sum / world);
    }
    const auto got = params(workers[0].out);
    EXPECT_EQ(got.size(), mean.size()) << scenario;
    if (got.size() != mean.size()) return 0;
    int64_t differ = 0, outside = 0;
    for (size_t i = 0; i < mean.size(); ++i) {
      const float err = std::abs(got[i] - mean[i]);
      if (err > 0) ++differ;
      if (err > rel * scale[i] + 1e-7f) {
        if (outside++ < 5) {
          ADD_FAILURE() << scenario << " element " << i << ": " << got[i] << " vs mean " << mean[i]
                        << " (ranks' largest magnitude " << scale[i] << ")";
        }
      }
    }
    EXPECT_EQ(outside, 0) << scenario << ": elements outside the rounding bound";
    for (int r = 1; r < world; ++r) EXPECT_EQ(params(workers[r].out), got) << "rank " << r;
    return differ;
  }

  ampx_test::TempFolder tmp_{"ampx-dist"};
  fs::path dir_ = tmp_.path();
};

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

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
  auto model = torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(),
                                     torch::nn::Linear(32, 16), torch::nn::Tanh(),
                                     torch::nn::Linear(16, 4));
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
  const int64_t sharded = state_bytes(workers[0].output, 0), full = state_bytes(workers[0].output, 1);
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
  EXPECT_LT(std::sqrt(apart / moved), 0.02) << "|zero - ddp| = " << std::sqrt(apart)
                                            << ", |ddp - start| = " << std::sqrt(moved);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(params(workers[r].out.string() + ".resumed"), zero) << "rank " << r;
  }
  // Unsharded O2: fp32 masters of the bf16 weights + 2 moments = 12 B per
  // element, 8 for the fp32 norm (its own master). Sharded: 12 B for each
  // element of this rank's shard of each dtype space (fp32 copy + moments).
  const int64_t sharded = state_bytes(workers[0].output, 0), full = state_bytes(workers[0].output, 1);
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
