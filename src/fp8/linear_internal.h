#pragma once

// The FP8 product both layer kinds run: ampx::fp8::Linear (linear.cpp) and a
// converted torch::nn::Linear (convert.cpp).

#include "ampx/fp8/scaling.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <memory>

namespace ampx {
namespace fp8 {
namespace detail {

/// y = FP8(x) @ FP8(weight)^T + bias with `scaling`, in `output_dtype` (unset:
/// the autocast dtype of x's device when autocast is on there, else
/// bfloat16); the autograd function both layer kinds run.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      const std::shared_ptr<LinearScaling>& scaling,
                      const c10::optional<c10::ScalarType>& output_dtype);

}  // namespace detail
}  // namespace fp8
}  // namespace ampx
