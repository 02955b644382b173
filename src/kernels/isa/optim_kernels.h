#pragma once

// Per-instruction-set fused optimizer kernels (ampx::optim). Each .cpp in
// src/kernels/isa/ is compiled once per ISA with CPU_CAPABILITY set to
// DEFAULT, AVX2 or AVX512 (see unscale_kernels.h); this header declares the
// optimizer span kernels in each of those namespaces.
//
// A span kernel updates elements [begin, end) of one parameter in a single
// pass: it reads the gradient, the weight (fp32 master or the param itself)
// and the fp32 states once, and writes each of them once.

#include "isa_dispatch.h"

#include "../optim_math.h"

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace ampx {
namespace detail {
namespace cpu {

/// One parameter's operands and its per-step scalars, all precomputed in
/// double by the driver and rounded to float once.
struct FusedParam {
  void* param = nullptr;                // fp32, bf16 or fp16, dense, numel elements
  float* master = nullptr;              // fp32 master or null (fp32 param / no masters)
  const void* grad = nullptr;           // same dtype as param
  float* exp_avg = nullptr;             // fp32 first moment / momentum buffer, or null
  float* exp_avg_sq = nullptr;          // fp32 second moment, or null
  c10::ScalarType dtype = c10::kFloat;  // param and grad dtype
  bool stochastic_rounding = false;     // bf16 params without master only
  uint64_t rng_key = 0;                 // hash of (seed, step, param index)

  float grad_mul = 1.f;  // 1 / grad_scale * clip coefficient
  float lr = 0.f;
  float beta1 = 0.f, beta2 = 0.f, eps = 0.f;
  float one_minus_beta1 = 1.f, one_minus_beta2 = 1.f;  // computed in double, as LibTorch
  float weight_decay = 0.f;
  float decay_factor = 1.f;  // AdamW: 1 - lr * weight_decay
  float step_size = 0.f;     // AdamW: lr / bias_correction1; LAMB: lr * trust ratio
  float bias_correction1 = 1.f;
  float bias_correction2 = 1.f;                     // LAMB
  float bias_correction2_sqrt = 1.f;                // AdamW
  float momentum = 0.f, one_minus_dampening = 1.f;  // SGD
  bool nesterov = false;
  bool first_step = false;  // SGD: momentum buffer := d_p
};

#define AMPX_DECLARE_OPTIM_KERNELS(ns)                                                   \
  namespace ns {                                                                         \
  void adamw_span(const FusedParam& p, int64_t begin, int64_t end);                      \
  void sgd_span(const FusedParam& p, int64_t begin, int64_t end);                        \
  /* Updates exp_avg / exp_avg_sq; adds sum(w^2), sum(update^2) to sums[0], sums[1]. */  \
  void lamb_moments_span(const FusedParam& p, int64_t begin, int64_t end, double* sums); \
  /* w -= step_size * update, update recomputed from the new moments. */                 \
  void lamb_apply_span(const FusedParam& p, int64_t begin, int64_t end);                 \
  }
AMPX_DECLARE_OPTIM_KERNELS(DEFAULT)
AMPX_DECLARE_OPTIM_KERNELS(AVX2)
AMPX_DECLARE_OPTIM_KERNELS(AVX512)
#undef AMPX_DECLARE_OPTIM_KERNELS

struct OptimKernels {
  void (*adamw)(const FusedParam&, int64_t, int64_t);
  void (*sgd)(const FusedParam&, int64_t, int64_t);
  void (*lamb_moments)(const FusedParam&, int64_t, int64_t, double*);
  void (*lamb_apply)(const FusedParam&, int64_t, int64_t);
};

#define AMPX_OPTIM_BUILD(ns)                                                     \
  OptimKernels {                                                                 \
    &ns::adamw_span, &ns::sgd_span, &ns::lamb_moments_span, &ns::lamb_apply_span \
  }
AMPX_ISA_DISPATCH(OptimKernels, optim_kernels_for, AMPX_OPTIM_BUILD)
#undef AMPX_OPTIM_BUILD

/// Stochastic rounding's random bits (kernels/optim_math.h, shared with CUDA).
using math::sr_bits;
using math::sr_key;

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
