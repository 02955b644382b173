#pragma once

// What the FP8 region (ampx/fp8/autocast.h) tells the rest of src/fp8: the
// group of this thread's region, and where an amax waits for its reduction.

#include "ampx/fp8/autocast.h"
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

/// The weight_casts of this thread's innermost region; kEveryForward outside
/// a region and in a disabled one.
WeightCasts region_weight_casts();

/// Queues `state`'s `amax` for the max-reduction over `group`: with the
/// region's forward amaxes while this thread's region has that group (reduced
/// by its finish()), else with the running backward's (reduced when it ends).
void defer_amax(std::shared_ptr<TensorScaling> state, at::Tensor amax,
                const dist::ProcessGroup* group);

/// Queues the amax of a delayed-scaling state on CUDA for the one update
/// launch (record_all) at the end of this thread's region, or, in an FP8
/// layer's backward (BackwardCasts), at the end of the running backward;
/// false outside both (the caller records at once).
bool defer_update(std::shared_ptr<TensorScaling> state, at::Tensor amax);

/// While one lives, this thread runs an FP8 layer's backward: its casts'
/// updates wait for the end of the backward (defer_update).
class BackwardCasts {
 public:
  BackwardCasts();
  ~BackwardCasts();
  BackwardCasts(const BackwardCasts&) = delete;
  BackwardCasts& operator=(const BackwardCasts&) = delete;

 private:
  bool previous_;
};

}  // namespace detail
}  // namespace fp8
}  // namespace ampx
