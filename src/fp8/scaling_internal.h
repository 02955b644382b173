#pragma once

// What scaling.cpp gives the rest of src/fp8: a delayed-scaling state as the
// CUDA update kernel takes it, and the recording of many amaxes at once.

#include "ampx/fp8/scaling.h"
#include "cuda_cast.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace ampx {
namespace fp8 {
namespace detail {

/// `state`'s tensors and constants for cuda::delayed_update, with this
/// step's `amax` (float32 [1] on the state's device).
cuda::DelayedArgs delayed_args(const DelayedScalingState& state, const at::Tensor& amax);

/// states[i]->record(amaxes[i]) for every i, the delayed-scaling updates of
/// the states on CUDA in one launch.
void record_all(const std::vector<std::shared_ptr<TensorScaling>>& states,
                const std::vector<at::Tensor>& amaxes);

}  // namespace detail
}  // namespace fp8
}  // namespace ampx
