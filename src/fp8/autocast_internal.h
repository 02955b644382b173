#pragma once

// What the FP8 region (ampx/fp8/autocast.h) tells the rest of src/fp8: the
// group of this thread's region, and where an amax waits for its reduction.

#include "ampx/fp8/scaling.h"

#include <ATen/core/Tensor.h>

#include <memory>

namespace ampx {
namespace dist {
class ProcessGroup;
}  // namespace dist

namespace fp8 {
namespace detail {

/// The amax_reduction_group of this thread's innermost region; null outside
/// a region, in a disabled one, or in one without a group.
const dist::ProcessGroup* region_group();

/// Queues `state`'s `amax` for the max-reduction over `group`: with the
/// region's forward amaxes while this thread's region has that group (reduced
/// by its finish()), else with the running backward's (reduced when it ends).
void defer_amax(std::shared_ptr<TensorScaling> state, at::Tensor amax,
                const dist::ProcessGroup* group);

}  // namespace detail
}  // namespace fp8
}  // namespace ampx
