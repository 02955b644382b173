#pragma once

// Arithmetic on the loss scale that must come out bit-identical wherever it
// is done: GradScaler::unscale_, the scaler-aware optimizer step and ZeRO's
// unscale and clip all divide gradients by the same float32 number.

#include <ATen/ATen.h>

namespace ampx {
namespace detail {

/// 1 / scale as PyTorch's GradScaler.unscale_ forms it: the reciprocal taken
/// in double, then rounded once to float32. scale: float32 [] (or [1]);
/// returns float32 of the same shape, on the same device, without a sync.
inline at::Tensor inverse_scale(const at::Tensor& scale) {
  return scale.to(at::kDouble).reciprocal().to(at::kFloat);
}

}  // namespace detail
}  // namespace ampx
