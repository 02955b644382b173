#pragma once

/// \file
/// ScaleUpdateRule: how dynamic loss scaling moves the scale after each
/// iteration. GradScaler builds one from its options; ampx::update_scale_
/// (ampx/kernels/loss_scale.h) applies one to tensors, for custom scalers.
///
/// ```
///   ampx::ScaleUpdateRule rule;       // PyTorch's: x2 every 2000 clean steps, x0.5 on inf
///   rule.hysteresis = 2;              // Megatron/DeepSpeed: back off at the 2nd overflow
///   ampx::update_scale_(scale, growth_tracker, hysteresis_tracker, found_inf, rule);
/// ```
///
/// One update, in place, on the scale's device:
///
/// ```
///   found_inf != 0: growth_tracker = 0; hysteresis_tracker -= 1 (not below 0);
///                   if hysteresis_tracker == 0: scale *= backoff_factor
///   otherwise:      growth_tracker += 1; when it reaches growth_interval:
///                   scale *= growth_factor unless that is not finite,
///                   growth_tracker = 0, hysteresis_tracker = hysteresis
/// ```
/// then scale is clamped to [min_scale, max_scale]. Products are formed in
/// double and rounded to float32, as ATen's `_amp_update_scale_` does. With
/// hysteresis == 1 and no bounds this is exactly `_amp_update_scale_`.

#include <c10/util/Optional.h>

#include <cstdint>

namespace ampx {

/// The dynamic loss-scale update rule: PyTorch's, plus hysteresis and bounds.
struct ScaleUpdateRule {
  double growth_factor = 2.0;      ///< scale *= this after growth_interval clean steps
  double backoff_factor = 0.5;     ///< scale *= this on an overflow (after hysteresis)
  int64_t growth_interval = 2000;  ///< consecutive clean steps before the scale grows
  /// Overflowing steps absorbed before backing off (Megatron/DeepSpeed
  /// semantics); refilled whenever the scale grows. 1 = PyTorch.
  int64_t hysteresis = 1;
  c10::optional<double> min_scale;  ///< floor of the scale after each update; none: no floor
  c10::optional<double> max_scale;  ///< ceiling of the scale after each update; none: no ceiling
};

}  // namespace ampx
