#pragma once

/// \file
/// ampx::optim::SGD: torch::optim::SGD's update (L2 weight decay added to the
/// gradient, momentum buffer started from the first gradient, dampening,
/// Nesterov) as one fused pass, with fp32 master weights. See optimizer.h.
///
/// ```
///   ampx::optim::SGD opt(model->parameters(), ampx::optim::SGDOptions(0.1).momentum(0.9));
/// ```

#include "ampx/optim/optimizer.h"

#include <torch/arg.h>

namespace ampx {
namespace optim {

/// SGD's options, set by chained calls as LibTorch's.
struct SGDOptions : public torch::optim::OptimizerCloneableOptions<SGDOptions> {
  /// Learning rate `lr`, the rest as below.
  SGDOptions(double lr);  // NOLINT: implicit, as torch::optim::SGDOptions
  /// Learning rate (>= 0).
  TORCH_ARG(double, lr);
  /// Momentum factor (>= 0); 0 keeps no buffer.
  TORCH_ARG(double, momentum) = 0;
  /// Dampening of the momentum's gradient term.
  TORCH_ARG(double, dampening) = 0;
  /// L2 penalty added to the gradient (>= 0).
  TORCH_ARG(double, weight_decay) = 0;
  /// Nesterov momentum (needs momentum > 0 and dampening 0).
  TORCH_ARG(bool, nesterov) = false;
  /// See AdamWOptions: optimizer-wide mixed-precision settings.
  TORCH_ARG(bool, master_weights) = true;
  /// bf16 params without masters: round the update stochastically.
  TORCH_ARG(bool, stochastic_rounding) = false;
  /// bf16/fp16 params without masters: keep the weight's lost low bits in a
  /// compensation buffer of the param's dtype, 2 bytes a parameter (needs
  /// master_weights(false); optimizer-wide).
  TORCH_ARG(bool, kahan_summation) = false;
  /// How the moments are stored (optimizer-wide; see StateFormat).
  TORCH_ARG(StateFormat, state_format) = StateFormat::kFp32;
  /// FP8 / 8-bit moments: elements per scale, a power of 2 in [32, 4096]
  /// (optimizer-wide).
  TORCH_ARG(int64_t, state_block) = 256;
  /// Params of fewer elements keep fp32 moments in any format (optimizer-wide).
  TORCH_ARG(int64_t, state_min_numel) = 4096;
  /// Seed of stochastic rounding's counter-based hash.
  TORCH_ARG(uint64_t, seed) = 0;
  /// Clip the global 2-norm of the (unscaled) grads to this, in the update.
  TORCH_ARG(c10::optional<double>, max_grad_norm) = c10::nullopt;

  /// lr(), for LibTorch's learning-rate schedulers.
  double get_lr() const override { return lr(); }
  /// Sets lr(), for LibTorch's learning-rate schedulers.
  void set_lr(const double lr) override { this->lr(lr); }
};

/// torch::optim::SGD's update, fused, with fp32 master weights (the top of this header).
class SGD : public MixedPrecisionOptimizer {
 public:
  /// Optimizes `param_groups`, each with its own options or else `defaults`.
  explicit SGD(std::vector<torch::optim::OptimizerParamGroup> param_groups, SGDOptions defaults);
  /// One group of `params` with `defaults`.
  explicit SGD(std::vector<at::Tensor> params, SGDOptions defaults);
  const char* name() const override { return "SGD"; }
  /// The momentum buffer of `param` (undefined before its first step or without momentum).
  at::Tensor momentum_buffer(const at::Tensor& param) const { return exp_avg(param); }

 protected:
  bool uses_exp_avg(const torch::optim::OptimizerOptions& group) const override;
  bool uses_exp_avg_sq() const override { return false; }
  detail::FusedOptions fused_options(size_t group) const override;
  void update_generic(detail::ParamWork& work, const at::Tensor& grad,
                      const at::Tensor& skip) override;
};

}  // namespace optim
}  // namespace ampx
