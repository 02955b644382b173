#pragma once

// The per-element arithmetic of ampx::optim, written once for both devices:
// the CPU span kernels (cpu_span.cpp, V = at::vec's float vector and
// V = float) and the CUDA multi-tensor kernels (cuda_step.cu, V = float)
// instantiate the same templates, and the per-step scalars (bias
// corrections, step sizes) come from the same double-precision functions on
// the host and on the device (fused_step.h builds each update from them).
// The CPU tests of the optimizers therefore check the arithmetic the GPU runs.
//
// Float expressions are evaluated in the order written, as LibTorch's
// torch::optim writes them; the CUDA file is compiled without FMA
// contraction (--fmad=false) so that a GPU step rounds as the CPU's does.

#include "../../kernels/host_device.h"

#include <cmath>
#include <cstdint>

namespace ampx {
namespace detail {
namespace math {

// --- square root: float here; a vector type's own .sqrt() -----------------

template <class V>
AMPX_HD V vsqrt(const V& x) {
  return x.sqrt();
}
AMPX_HD float vsqrt(float x) {
#if defined(__CUDA_ARCH__)
  return sqrtf(x);  // correctly rounded (nvcc's default -prec-sqrt=true)
#else
  return std::sqrt(x);
#endif
}

// --- the updates: operator()(w, g, m, v) on fp32 values --------------------
// w: the weight (fp32 master or the widened param); g: the gradient, already
// multiplied by grad_mul; m, v: fp32 states. kGrad / kM / kV say what an op
// reads, kWriteW / kWriteState what it writes.

/// torch::optim::AdamW: w *= 1 - lr*wd; m = m*b1 + g*(1-b1);
/// v = v*b2 + (1-b2)*g*g; w += (-lr/bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
struct AdamWOp {
  static constexpr bool kGrad = true, kM = true, kV = true, kWriteW = true, kWriteState = true;
  float decay, b1, omb1, b2, omb2, bc2_sqrt, eps, neg_step;
  template <class V>
  AMPX_HD void operator()(V& w, V g, V& m, V& v) const {
    w = w * V(decay);
    m = m * V(b1) + g * V(omb1);
    v = v * V(b2) + V(omb2) * g * g;
    const V denom = vsqrt(v) / V(bc2_sqrt) + V(eps);
    w = w + V(neg_step) * m / denom;
  }
};

/// torch::optim::SGD: d = g + wd*w; buf = first ? d : buf*mom + (1-damp)*d;
/// d = nesterov ? d + mom*buf : buf; w += (-lr) * d.
template <bool kMomentum>
struct SgdOp {
  static constexpr bool kGrad = true, kM = kMomentum, kV = false, kWriteW = true,
                        kWriteState = kMomentum;
  float wd, mom, omdamp, neg_lr;
  bool nesterov, first;
  template <class V>
  AMPX_HD void operator()(V& w, V g, V& m, V& v) const {
    V d = g;
    if (wd != 0.f) d = d + w * V(wd);
    if (kMomentum) {
      m = first ? d : m * V(mom) + d * V(omdamp);
      d = nesterov ? d + m * V(mom) : m;
    }
    w = w + d * V(neg_lr);
  }
};

/// LAMB's update direction from the new moments:
/// u = (m / bc1) / (sqrt(v / bc2) + eps) + wd * w.
struct LambDir {
  float bc1, bc2, eps, wd;
  template <class V>
  AMPX_HD V operator()(const V& w, const V& m, const V& v) const {
    return (m / V(bc1)) / (vsqrt(v / V(bc2)) + V(eps)) + V(wd) * w;
  }
};

/// LAMB's first pass: the moments, as Adam's, then w^2 and u^2 (u from the
/// new moments) added to the accumulator: acc->add(w, u) for V = float and,
/// on the CPU, for the vector type.
template <class Acc>
struct LambMomentsOp {
  static constexpr bool kGrad = true, kM = true, kV = true, kWriteW = false, kWriteState = true;
  float b1, omb1, b2, omb2;
  LambDir dir;
  Acc* acc;
  template <class V>
  AMPX_HD void operator()(V& w, V g, V& m, V& v) const {
    m = m * V(b1) + g * V(omb1);
    v = v * V(b2) + V(omb2) * g * g;
    acc->add(w, dir(w, m, v));
  }
};

/// LAMB's first pass over coded moments: w^2 and u^2 from the moments as
/// stored (encoded and decoded again), so that the trust ratio is that of
/// the update the second pass applies.
template <class Acc>
struct LambSumsOp {
  static constexpr bool kGrad = false, kM = true, kV = true, kWriteW = false, kWriteState = false;
  LambDir dir;
  Acc* acc;
  template <class V>
  AMPX_HD void operator()(V& w, V, V& m, V& v) const {
    acc->add(w, dir(w, m, v));
  }
};

/// LAMB's second pass: w -= lr * trust_ratio * u.
struct LambApplyOp {
  static constexpr bool kGrad = false, kM = true, kV = true, kWriteW = true, kWriteState = false;
  LambDir dir;
  float neg_step;
  template <class V>
  AMPX_HD void operator()(V& w, V g, V& m, V& v) const {
    w = w + V(neg_step) * dir(w, m, v);
  }
};

/// LAMB's trust ratio ||w|| / ||u||, 1 when either norm is 0.
AMPX_HD double lamb_trust_ratio(double w_sq, double u_sq) {
  const double w_norm = sqrt(w_sq), u_norm = sqrt(u_sq);
  return (w_norm > 0 && u_norm > 0) ? w_norm / u_norm : 1.0;
}

// --- one element of one param through an update ---------------------------

/// Element i of a param through `op` (AdamWOp, ...), all in fp32: the
/// gradient widened and multiplied by grad_mul, the weight read from the
/// master (or the param widened), the states read and written as the op
/// says, the new weight written to the master and, rounded by
/// `narrow(w, i)`, to the param. `Operands` has the pointers param, master
/// (or null), grad, exp_avg, exp_avg_sq; T is the param's dtype.
template <class T, class Op, class Operands, class Narrow>
AMPX_HD void update_element(const Operands& p, int64_t i, float grad_mul, const Op& op,
                            const Narrow& narrow) {
  T* param = static_cast<T*>(p.param);
  float g = 0.f;
  if (Op::kGrad) g = static_cast<float>(static_cast<const T*>(p.grad)[i]) * grad_mul;
  float w = p.master ? p.master[i] : static_cast<float>(param[i]);
  float m = Op::kM ? p.exp_avg[i] : 0.f;
  float v = Op::kV ? p.exp_avg_sq[i] : 0.f;
  op(w, g, m, v);
  if (Op::kWriteState) {
    if (Op::kM) p.exp_avg[i] = m;
    if (Op::kV) p.exp_avg_sq[i] = v;
  }
  if (Op::kWriteW) {
    if (p.master) p.master[i] = w;
    param[i] = narrow(w, i);
  }
}

// --- per-step scalars, in double as LibTorch computes them, each rounded to
// float once; `step` counts this step (1 at the first) -----------------------

struct AdamWScalars {
  float decay;      // 1 - lr * weight_decay
  float step_size;  // lr / (1 - b1^step)
  float bc2_sqrt;   // sqrt(1 - b2^step)
};
AMPX_HD AdamWScalars adamw_scalars(double lr, double b1, double b2, double weight_decay,
                                   double step) {
  return {static_cast<float>(1 - lr * weight_decay), static_cast<float>(lr / (1 - pow(b1, step))),
          static_cast<float>(sqrt(1 - pow(b2, step)))};
}

struct LambScalars {
  float bc1, bc2;  // 1 - b1^step, 1 - b2^step
};
AMPX_HD LambScalars lamb_scalars(double b1, double b2, double step) {
  return {static_cast<float>(1 - pow(b1, step)), static_cast<float>(1 - pow(b2, step))};
}

// --- stochastic rounding to bf16 -------------------------------------------

/// A counter-based hash (splitmix64's finalizer): a rounding's random bits
/// depend only on where and when it happens (seed, step, param position,
/// element index), never on threads, chunking or the device.
AMPX_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

AMPX_HD uint64_t sr_key(uint64_t seed, int64_t step, int64_t param_index) {
  return mix64(mix64(seed ^ 0x5851f42d4c957f2dULL) +
               static_cast<uint64_t>(step) * 0x9e3779b97f4a7c15ULL +
               mix64(static_cast<uint64_t>(param_index) + 0x2545f4914f6cdd1dULL));
}

/// 16 random bits for element `index` under `key`.
AMPX_HD uint32_t sr_bits(uint64_t key, int64_t index) {
  return static_cast<uint32_t>(mix64(key + static_cast<uint64_t>(index) * 0x9e3779b97f4a7c15ULL) >>
                               48);
}

/// The bf16 bits of x rounded stochastically: adding 16 random bits below
/// the kept 16 carries into the kept part with probability (dropped bits) /
/// 2^16, so the rounding is unbiased. inf stays inf (its low bits are zero);
/// NaN becomes 0x7fc0, as c10::BFloat16's nearest-even rounding makes it on
/// the CPU.
AMPX_HD uint16_t bf16_bits_stochastic(float x, uint32_t random16) {
  uint32_t bits = float_bits(x);
  if ((bits & 0x7f800000u) == 0x7f800000u) {
    return (bits & 0x007fffffu) ? uint16_t{0x7fc0} : static_cast<uint16_t>(bits >> 16);
  }
  bits += random16;
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace math
}  // namespace detail
}  // namespace ampx
