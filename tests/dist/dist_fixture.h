#pragma once

// What dist_test.cpp and zero_test.cpp share: DistTest, which starts
// tests/helpers/dist_worker.cpp's ranks, and what the legs' Gloo sums.

#include <ampx/dist.h>

#include "../rank_launch.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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

#ifdef AMPX_DIST_WORKER

namespace ampx_test {

namespace fs = std::filesystem;

// Whether this LibTorch's Gloo sums `type`, found as DistributedDataParallel
// finds it: a one-element all-reduce, here in a group of one. Builds differ:
// 1.13's sums float16 only, Debian's 2.6 both 16-bit floats, Debian's 2.14
// neither ("Gloo: Invalid scalar type").
inline bool gloo_sums(at::ScalarType type) {
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
inline std::string refusal(at::ScalarType type) {
  const auto other = type == at::kBFloat16 ? at::kHalf : at::kBFloat16;
  return std::string("DistributedDataParallel: this LibTorch's Gloo cannot all-reduce ") +
         c10::toString(type) + " gradients (communication_dtype); use " +
         (gloo_sums(other) ? std::string("torch::k") + c10::toString(other) + " or float32"
                           : std::string("float32 (it cannot sum Half or BFloat16)"));
}

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

inline float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

}  // namespace ampx_test

#endif  // AMPX_DIST_WORKER
