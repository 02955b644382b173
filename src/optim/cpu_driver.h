#pragma once

// The CPU side of ampx::optim's steps: turns ParamWork into the span
// kernels' operands; the spans run over all params in 64K-element chunks
// (kernels/cpu/chunks.h: many small params parallelise as well as one big one).

#include "ampx/optim/optimizer.h"

#include "../kernels/cpu/chunks.h"
#include "../kernels/isa/optim_kernels.h"

#include <cstdint>
#include <vector>

namespace ampx {
namespace optim {
namespace detail {

namespace cpu = ::ampx::detail::cpu;
using cpu::FusedParam;

/// Pointers, dtype and stochastic-rounding key of `work` (scalars left to the caller).
FusedParam fused_operands(const ParamWork& work, const MixedPrecisionConfig& config,
                          float grad_mul);

/// Adam's moment operands (betas, 1 - betas, eps), computed in double as
/// LibTorch does and rounded to float once; AdamW and LAMB share them.
inline void set_adam_moments(FusedParam& p, double beta1, double beta2, double eps) {
  p.beta1 = static_cast<float>(beta1);
  p.beta2 = static_cast<float>(beta2);
  p.one_minus_beta1 = static_cast<float>(1 - beta1);
  p.one_minus_beta2 = static_cast<float>(1 - beta2);
  p.eps = static_cast<float>(eps);
}

/// The span kernels of the best instruction set this CPU runs.
const cpu::OptimKernels& optim_kernels();

// The chunked multi-tensor loop, shared with the unscale kernel.
using cpu::for_each_chunk;
using cpu::kChunkElems;
using cpu::make_chunks;

}  // namespace detail
}  // namespace optim
}  // namespace ampx
