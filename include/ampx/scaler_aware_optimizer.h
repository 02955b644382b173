#pragma once

/// \file
/// ScalerAwareOptimizer: the interface through which GradScaler::step hands an
/// optimizer the loss scale instead of unscaling its gradients (PyTorch's
/// `_step_supports_amp_scaling`, e.g. fused Adam). ampx::optim's optimizers
/// and ampx::dist::ZeroRedundancyOptimizer implement it.
///
/// ```
///   class MyOptimizer : public torch::optim::Optimizer, public ampx::ScalerAwareOptimizer {
///     void step_scaled(const at::Tensor& grad_scale, const at::Tensor& found_inf) override;
///   };
///   scaler.step(my_opt);  // calls my_opt.step_scaled(scale, found_inf): no host sync
/// ```

#include <ATen/core/Tensor.h>

namespace ampx {

/// Implemented by optimizers that unscale gradients and skip an overflowing
/// step inside their own step, without a host synchronisation. GradScaler::step
/// hands them the scale instead of unscaling the gradients itself.
class ScalerAwareOptimizer {
 public:
  virtual ~ScalerAwareOptimizer() = default;
  /// One step. `grad_scale` (float32 [], on the scaler's device): the
  /// gradients are still multiplied by it; undefined if unscale_() already
  /// divided them. `found_inf` (float32 []): nonzero means a gradient was
  /// inf/NaN and the step must leave parameters and state untouched.
  virtual void step_scaled(const at::Tensor& grad_scale, const at::Tensor& found_inf) = 0;
};

}  // namespace ampx
