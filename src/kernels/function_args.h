#pragma once

// What ampx's CPU ops share around their kernels (src-internal):
//
//   at::parallel_for(0, n, kElementwiseGrain, ...);        // elementwise loops
//   Function::apply(x, optional_tensor(bias), ...);        // an optional operand
//   const at::Tensor bias = tensor_or_undefined(bias_arg); // and back, inside
//
// LibTorch 1.13's autograd::Function::apply cannot take an undefined tensor
// argument, so an operand that may be absent (a bias, a norm's weight)
// crosses apply() as a c10::optional<at::Tensor>.

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace ampx {
namespace detail {

/// Elements per parallel task in elementwise loops (casts, GELU, finiteness
/// scans): 32768, 64-128 KiB of 16- and 32-bit data, enough to outweigh a
/// task's start. Loops over rows, channels or chunks choose their own.
inline constexpr int64_t kElementwiseGrain = 32768;

inline c10::optional<at::Tensor> optional_tensor(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

inline at::Tensor tensor_or_undefined(const c10::optional<at::Tensor>& t) {
  return t ? *t : at::Tensor();
}

}  // namespace detail
}  // namespace ampx
