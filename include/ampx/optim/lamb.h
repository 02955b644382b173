#pragma once

/// \file
/// ampx::optim::LAMB (You et al. 2019, as Apex's FusedLAMB with adam_w_mode):
/// Adam moments with bias correction, update u = m_hat / (sqrt(v_hat) + eps)
/// + weight_decay * w, and a per-tensor trust ratio ||w|| / ||u|| (1 when
/// either norm is 0): w -= lr * ratio * u. Unlike Apex (which applies the
/// ratio only when weight_decay != 0 unless use_nvlamb), the ratio is always
/// applied, as in the paper. Two passes per tensor: moments + norms, then the
/// weight update. See optimizer.h for master weights.

#include "ampx/optim/optimizer.h"

#include <torch/arg.h>

#include <tuple>

namespace ampx {
namespace optim {

/// LAMB's options, set by chained calls as LibTorch's.
struct LAMBOptions : public torch::optim::OptimizerCloneableOptions<LAMBOptions> {
  /// (beta1, beta2): the decay rates of the first and second moments.
  using betas_t = std::tuple<double, double>;
  /// Learning rate `lr`, the rest as below.
  LAMBOptions(double lr = 1e-3);  // NOLINT: implicit, as LibTorch's options
  /// Learning rate (>= 0).
  TORCH_ARG(double, lr) = 1e-3;
  /// Moment decay rates, each in [0, 1).
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  /// Added to the denominator (>= 0); Apex's default.
  TORCH_ARG(double, eps) = 1e-6;
  /// Weight decay inside the update (>= 0).
  TORCH_ARG(double, weight_decay) = 1e-2;
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

/// LAMB (You et al. 2019), fused, with fp32 master weights (the top of this header).
class LAMB : public MixedPrecisionOptimizer {
 public:
  /// Optimizes `param_groups`, each with its own options or else `defaults`.
  explicit LAMB(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                LAMBOptions defaults = {});
  /// One group of `params` with `defaults`.
  explicit LAMB(std::vector<at::Tensor> params, LAMBOptions defaults = {});
  const char* name() const override { return "LAMB"; }

 protected:
  bool uses_exp_avg(const torch::optim::OptimizerOptions&) const override { return true; }
  bool uses_exp_avg_sq() const override { return true; }
  bool reads_param_norms() const override { return true; }
  detail::FusedOptions fused_options(size_t group) const override;
  void update_generic(detail::ParamWork& work, const at::Tensor& grad,
                      const at::Tensor& skip) override;
};

}  // namespace optim
}  // namespace ampx
