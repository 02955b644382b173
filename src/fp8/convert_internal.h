#pragma once

// The dispatcher interception of convert_linears (src/fp8/convert.cpp), as
// the region (src/fp8/autocast.cpp) turns it on and off.

#include <c10/core/DispatchKey.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

namespace torch {
namespace nn {
class LinearImpl;
}  // namespace nn
}  // namespace torch

namespace ampx {
namespace fp8 {
namespace detail {

// The dispatch key converted torch::nn::Linear layers are caught on: a mode
// key above Autocast and Autograd that LibTorch registers nothing on
// (ampx::debug uses TESTING_ONLY_GenericMode, the one above it).
constexpr c10::DispatchKey kFp8LinearKey = c10::DispatchKey::TESTING_ONLY_GenericWrapper;

/// Registers, once, a fallthrough for every op on kFp8LinearKey and the
/// kernels for aten::linear/addmm/matmul that route converted layers to FP8.
void register_linear_kernels();

/// Makes `linear` run a wide product inside an FP8 region (kFloat or kHalf,
/// as wide_linear in linear_internal.h), converted before or not: an FP8
/// recipe it had is dropped, its buffers stay. A precision plan's fp32 and
/// fp16 layers (src/plan/). reconvert_linear(linear, nullopt) undoes it.
void set_wide_product(torch::nn::LinearImpl& linear, c10::ScalarType product);

/// The wide product set_wide_product gave `linear`, if any.
c10::optional<c10::ScalarType> wide_product_of(const torch::nn::LinearImpl& linear);

}  // namespace detail
}  // namespace fp8
}  // namespace ampx
