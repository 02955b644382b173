#pragma once

// The two kernels of dynamic loss scaling, usable on their own (e.g. by a
// custom optimizer or trainer). Each routes to ATen's own kernel where this
// LibTorch build has one for the tensors' device, and to ampx's otherwise:
// LibTorch 1.13 has CPU kernels for neither, and CUDA's unscale kernel lacks
// bfloat16. No function here synchronises with the host.
//
//   auto found_inf = torch::zeros({1});            // float32, caller zeroes
//   ampx::non_finite_check_and_unscale_(grads, found_inf, inv_scale);
//   ampx::update_scale_(scale, growth_tracker, hysteresis_tracker, found_inf, rule);

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace ampx {

/// In place, for every tensor `g` in `grads`: `g *= inv_scale`, and
/// `found_inf = 1` if any element of any `g` is inf or NaN. `found_inf` is
/// never reset to 0 here (the caller zeroes it). `found_inf` and `inv_scale`
/// are 1-element float32 tensors on the grads' device; grads may be float32,
/// float64, float16 or bfloat16, each strided. Same contract as ATen's
/// `_amp_foreach_non_finite_check_and_unscale_`.
void non_finite_check_and_unscale_(at::TensorList grads, at::Tensor& found_inf,
                                   const at::Tensor& inv_scale);

/// The dynamic loss-scale update rule: PyTorch's, plus hysteresis and bounds.
struct ScaleUpdateRule {
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  /// Overflowing steps absorbed before backing off (Megatron/DeepSpeed
  /// semantics); refilled whenever the scale grows. 1 = PyTorch.
  int64_t hysteresis = 1;
  c10::optional<double> min_scale;
  c10::optional<double> max_scale;
};

/// One update of the loss scale, in place, on the scale's device:
///   found_inf != 0: growth_tracker = 0; hysteresis_tracker -= 1 (not below 0);
///                   if hysteresis_tracker == 0: scale *= backoff_factor
///   otherwise:      growth_tracker += 1; when it reaches growth_interval:
///                   scale *= growth_factor unless that is not finite,
///                   growth_tracker = 0, hysteresis_tracker = hysteresis
/// then scale is clamped to [min_scale, max_scale]. Products are formed in
/// double and rounded to float32, as ATen's `_amp_update_scale_` does.
/// `scale`: float32 [1]; trackers: int32 [1]; `found_inf`: float32 [1].
/// With hysteresis == 1 and no bounds this is exactly `_amp_update_scale_`.
void update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& hysteresis_tracker,
                   const at::Tensor& found_inf, const ScaleUpdateRule& rule);

}  // namespace ampx
