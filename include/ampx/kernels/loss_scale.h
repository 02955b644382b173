#pragma once

/// \file
/// The two kernels of dynamic loss scaling, usable on their own (e.g. by a
/// custom optimizer or trainer; GradScaler runs them). Each routes to ATen's
/// own kernel where this LibTorch build has one for the tensors' device, and
/// to ampx's otherwise: LibTorch 1.13 has CPU kernels for neither, and
/// CUDA's unscale kernel lacks bfloat16. Neither synchronises with the host.
///
/// ```
///   auto found_inf = torch::zeros({1});            // float32, caller zeroes
///   ampx::non_finite_check_and_unscale_(grads, found_inf, inv_scale);
///   found_inf.item<float>();                       // 1 if a gradient held inf or NaN, else 0
///   ampx::update_scale_(scale, growth_tracker, hysteresis_tracker, found_inf, rule);
///   scale.item<float>();                           // 65536 -> 32768 on an inf (rule's default)
/// ```

#include "ampx/scale_update.h"

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace ampx {

/// In place, for every tensor `g` in `grads`: `g *= inv_scale`, and
/// `found_inf = 1` if any element of any `g` is inf or NaN. `found_inf` is
/// never reset to 0 here (the caller zeroes it). `found_inf` and `inv_scale`
/// are 1-element float32 tensors on the grads' device; grads may be float32,
/// float64, float16 or bfloat16, each strided. Same contract as ATen's
/// `_amp_foreach_non_finite_check_and_unscale_`.
void non_finite_check_and_unscale_(at::TensorList grads, at::Tensor& found_inf,
                                   const at::Tensor& inv_scale);

/// One update of the loss scale, in place, on the scale's device, by `rule`
/// (see ScaleUpdateRule for the rule). `scale`: float32 [1]; trackers: int32
/// [1]; `found_inf`: float32 [1]. With hysteresis == 1 and no bounds this is
/// exactly ATen's `_amp_update_scale_`.
void update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& hysteresis_tracker,
                   const at::Tensor& found_inf, const ScaleUpdateRule& rule);

}  // namespace ampx
