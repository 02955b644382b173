#pragma once

// The fused optimizer step's CPU span kernels (cpu_span.cpp), compiled once
// per instruction set with CPU_CAPABILITY set to DEFAULT, AVX2 or AVX512
// (as the kernels of src/kernels/isa/ are; the CMake list names this file
// there). A span updates elements [begin, end) of one param in a single
// pass: it reads the gradient, the weight (fp32 master or the param itself)
// and the fp32 states once, and writes each of them once.

#include "fused_step.h"

#include "../../kernels/isa/isa_dispatch.h"

#include <cstdint>

namespace ampx {
namespace detail {
namespace cpu {

using optim::detail::FusedAt;
using optim::detail::FusedParam;

#define AMPX_DECLARE_OPTIM_KERNELS(ns)                                                        \
  namespace ns {                                                                              \
  /* AdamW or SGD, as p.options.update says. */                                               \
  void update_span(const FusedParam& p, const FusedAt& at, int64_t begin, int64_t end);       \
  /* LAMB's moments; adds sum(w^2), sum(u^2) to sums[0], sums[1]. */                          \
  void lamb_moments_span(const FusedParam& p, const FusedAt& at, int64_t begin, int64_t end,  \
                         double* sums);                                                       \
  /* LAMB's w += neg_step * u, u recomputed from the new moments. */                          \
  void lamb_apply_span(const FusedParam& p, const FusedAt& at, float neg_step, int64_t begin, \
                       int64_t end);                                                          \
  }
AMPX_DECLARE_OPTIM_KERNELS(DEFAULT)
AMPX_DECLARE_OPTIM_KERNELS(AVX2)
AMPX_DECLARE_OPTIM_KERNELS(AVX512)
#undef AMPX_DECLARE_OPTIM_KERNELS

struct OptimKernels {
  void (*update)(const FusedParam&, const FusedAt&, int64_t, int64_t);
  void (*lamb_moments)(const FusedParam&, const FusedAt&, int64_t, int64_t, double*);
  void (*lamb_apply)(const FusedParam&, const FusedAt&, float, int64_t, int64_t);
};

#define AMPX_OPTIM_BUILD(ns)                                       \
  OptimKernels {                                                   \
    &ns::update_span, &ns::lamb_moments_span, &ns::lamb_apply_span \
  }
AMPX_ISA_DISPATCH(OptimKernels, optim_kernels_for, AMPX_OPTIM_BUILD)
#undef AMPX_OPTIM_BUILD

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
