#pragma once

// What fp8_linear_test.cpp and fp8_convert_test.cpp share.

#include "ampx/fp8/linear.h"

#include <ATen/core/Tensor.h>

namespace ampx {
namespace test {

/// What the recipe defines: cast to the FP8 grid with the given scale, back.
inline at::Tensor grid(const at::Tensor& x, fp8::Fp8Format f, const at::Tensor& scale,
                       const at::Tensor& scale_inv) {
  return fp8::dequantize(fp8::quantize(x, f, scale), f, scale_inv, at::kFloat);
}

}  // namespace test
}  // namespace ampx
