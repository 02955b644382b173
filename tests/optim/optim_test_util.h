#pragma once

// What tests/optim's suites share: a small MLP, its training step, and how
// near two trajectories are.

#include "../test_util.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace optim_test {

using Net = ampx::test::Mlp;

// Same float expressions in the same order as LibTorch's optimizers: after 50
// steps the trajectories agree to 1e-6 (absolute, weights of order 0.1-1;
// in practice they are bitwise equal or within an ulp or two).
inline constexpr double kFp32Tol = 1e-6;

// Its input is cast to the parameters' dtype (tests cast them to bf16/fp16
// by hand) and its output to fp32.
inline Net make_net(int64_t seed, int64_t hidden = 16) {
  torch::manual_seed(seed);
  return Net(hidden, /*float_output=*/true);
}

inline double max_abs_diff(const std::vector<torch::Tensor>& a,
                           const std::vector<torch::Tensor>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).abs().max().item<double>());
  }
  return d;
}

inline torch::Tensor train_step(Net& net, torch::optim::Optimizer& opt, int64_t step) {
  const auto b = ampx::test::make_batch(100 + step);
  opt.zero_grad();
  auto loss = torch::mse_loss(net->forward(b.x), b.y);
  loss.backward();
  opt.step();
  return loss;
}

}  // namespace optim_test
