#pragma once

// The host side of the fused step (fused_step.h): FusedParam from a param's
// tensors, for either device, and the CPU step itself, whose spans
// (cpu_kernels.h) run over all params in 64K-element chunks
// (kernels/cpu/chunks.h: many small params parallelise as well as one big one).

#include "ampx/optim/optimizer.h"

#include "fused_step.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace ampx {
namespace optim {
namespace detail {

/// The kernels' name of `dtype`; throws for a dtype the fused step does not take.
FusedDtype fused_dtype(c10::ScalarType dtype);

/// The operands of `work` (its param, grad and states, on the CPU or one
/// CUDA device), its group's `options` and the switches of `config`.
FusedParam fused_param(const ParamWork& work, const FusedOptions& options,
                       const MixedPrecisionConfig& config);

/// LAMB's per-param sums of w^2 and u^2, made those of whole parameters
/// (MixedPrecisionOptimizer::set_piece_sums) in place.
using WholeSums = std::function<void(std::vector<double>& w_sq, std::vector<double>& u_sq)>;

/// One fused step over dense CPU params, all of one update; `steps[i]`
/// counts this step for params[i]. Grads are multiplied by `grad_mul`.
/// `whole_sums` (LAMB; may be null) runs between LAMB's two passes.
void cpu_step(const std::vector<FusedParam>& params, const std::vector<int64_t>& steps,
              float grad_mul, uint64_t seed, const WholeSums* whole_sums = nullptr);

}  // namespace detail
}  // namespace optim
}  // namespace ampx
