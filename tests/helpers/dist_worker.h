#pragma once

// What the sources of ampx_dist_worker share: the small MLP every rank
// trains, this rank's shard of the one global batch, the parameters' file,
// and the scenarios that main() (dist_worker.cpp) runs from the other files.

#include <ampx/dist.h>

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>

namespace dist_worker {

inline constexpr int64_t kGlobalBatch = 12;
inline constexpr int kSteps = 20;

/// The MLP (8 -> 32 -> 16 -> 4, tanh) from the weights of `seed`.
torch::nn::Sequential make_model(int64_t seed);
/// The same with a LayerNorm, which O2 keeps in fp32 (two parameter dtypes).
torch::nn::Sequential make_norm_model(int64_t seed);
/// This rank's rows (inputs, targets) of the global batch, which is the same
/// on every rank (seed 7).
std::pair<torch::Tensor, torch::Tensor> batch_shard(int64_t rank, int64_t world);
/// Writes every parameter as float32, in order, to `path`.
void write_params(const torch::nn::Sequential& model, const std::string& path);

/// The ZeRO-1 scenarios but zero-groups: zero, zero-o2, zero-overflow,
/// zero-unsynced (dist_worker_zero.cpp).
int run_zero(const std::string& scenario, const std::string& out, ampx::dist::ProcessGroup pg);
/// zero-groups (dist_worker_zero.cpp).
int run_zero_groups(const std::string& out, ampx::dist::ProcessGroup pg);
/// The plan-watch scenarios (dist_worker_plan.cpp).
int run_plan_watch(const std::string& scenario, const std::string& out,
                   ampx::dist::ProcessGroup pg);

}  // namespace dist_worker
