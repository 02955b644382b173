#pragma once

// The dispatcher interception of convert_linears (src/fp8/convert.cpp), as
// the region (src/fp8/autocast.cpp) turns it on and off.

#include <c10/core/DispatchKey.h>

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

}  // namespace detail
}  // namespace fp8
}  // namespace ampx
