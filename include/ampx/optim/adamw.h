#pragma once

/// \file
/// ampx::optim::AdamW: torch::optim::AdamW's update (decoupled weight decay
/// p *= 1 - lr * wd, then Adam with bias correction) as one fused pass, with
/// fp32 master weights for bf16/fp16 params. See optimizer.h.
///
/// ```
///   ampx::optim::AdamW opt(model->parameters(),
///                          ampx::optim::AdamWOptions(3e-4).weight_decay(0.1).max_grad_norm(1.0));
/// ```

#include "ampx/optim/optimizer.h"

#include <torch/arg.h>

#include <tuple>

namespace ampx {
namespace optim {

/// AdamW's options, set by chained calls as LibTorch's.
struct AdamWOptions : public torch::optim::OptimizerCloneableOptions<AdamWOptions> {
  /// (beta1, beta2): the decay rates of the first and second moments.
  using betas_t = std::tuple<double, double>;
  /// Learning rate `lr`, the rest as below.
  AdamWOptions(double lr = 1e-3);  // NOLINT: implicit, as torch::optim::AdamWOptions
  /// Learning rate (>= 0).
  TORCH_ARG(double, lr) = 1e-3;
  /// Moment decay rates, each in [0, 1).
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  /// Added to the denominator (>= 0).
  TORCH_ARG(double, eps) = 1e-8;
  /// Decoupled weight decay (>= 0): p *= 1 - lr * weight_decay before the Adam step.
  TORCH_ARG(double, weight_decay) = 1e-2;
  /// Keep fp32 master weights for bf16/fp16 params (optimizer-wide).
  TORCH_ARG(bool, master_weights) = true;
  /// bf16 params without masters: round the update stochastically (needs
  /// master_weights(false); optimizer-wide).
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
  /// Seed of stochastic rounding's counter-based hash (optimizer-wide).
  TORCH_ARG(uint64_t, seed) = 0;
  /// Clip the global 2-norm of the (unscaled) grads to this, fused into the
  /// update (optimizer-wide; clip_grad_norm_'s formula). None: no clipping.
  TORCH_ARG(c10::optional<double>, max_grad_norm) = c10::nullopt;

  /// lr(), for LibTorch's learning-rate schedulers.
  double get_lr() const override { return lr(); }
  /// Sets lr(), for LibTorch's learning-rate schedulers.
  void set_lr(const double lr) override { this->lr(lr); }
};

/// torch::optim::AdamW's update, fused, with fp32 master weights (the top of this header).
class AdamW : public MixedPrecisionOptimizer {
 public:
  /// Optimizes `param_groups`, each with its own options or else `defaults`.
  explicit AdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                 AdamWOptions defaults = {});
  /// One group of `params` with `defaults`.
  explicit AdamW(std::vector<at::Tensor> params, AdamWOptions defaults = {});
  const char* name() const override { return "AdamW"; }

 protected:
  bool uses_exp_avg(const torch::optim::OptimizerOptions&) const override { return true; }
  bool uses_exp_avg_sq() const override { return true; }
  detail::FusedOptions fused_options(size_t group) const override;
  void update_generic(detail::ParamWork& work, const at::Tensor& grad,
                      const at::Tensor& skip) override;
};

}  // namespace optim
}  // namespace ampx
