// Fused optimizer updates, compiled once per instruction set (see
// optim_kernels.h). One span = elements [begin, end) of one parameter; each
// operand is loaded once and stored once:
//   grad  (param dtype)  -> widened to fp32, multiplied by grad_mul
//   weight (fp32 master, or the param widened)
//   exp_avg, exp_avg_sq (fp32)
// bf16 goes through at::vec's bf16 <-> fp32 conversions (round to nearest
// even on the way back); fp16 runs per element (LibTorch 1.13 has no Half
// vectorization). Vector and scalar code evaluate the same float expressions
// in the same order without FMA contraction, so tails match vector lanes.

#include "optim_kernels.h"
#include "vec_math.h"

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;
using FVec = Vectorized<float>;
using BVec = Vectorized<c10::BFloat16>;

using math::vsqrt;

// Unbiased rounding to bf16 (kernels/optim_math.h).
inline c10::BFloat16 round_stochastic(float x, uint64_t key, int64_t index) {
  return c10::BFloat16(math::bf16_bits_stochastic(x, sr_bits(key, index)),
                       c10::BFloat16::from_bits());
}

template <class T>
inline T narrow(float w, const FusedParam& p, int64_t i) {
  return static_cast<T>(w);
}
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float w, const FusedParam& p, int64_t i) {
  return p.stochastic_rounding ? round_stochastic(w, p.rng_key, i) : c10::BFloat16(w);
}

template <class T>
struct Narrow {
  const FusedParam& p;
  T operator()(float w, int64_t i) const { return narrow<T>(w, p, i); }
};

// One element (the vector loops' tails; fp16 throughout): the shared
// update_element (kernels/optim_math.h), as the CUDA kernels run it.
template <class T, class Op>
inline void scalar_element(const FusedParam& p, int64_t i, Op& op) {
  math::update_element<T>(p, i, p.grad_mul, op, Narrow<T>{p});
}

template <class Op>
void run_float(const FusedParam& p, int64_t begin, int64_t end, Op& op) {
  float* w_ptr = static_cast<float*>(p.param);
  const float* g_ptr = static_cast<const float*>(p.grad);
  const FVec gm(p.grad_mul);
  int64_t i = begin;
  for (; i + FVec::size() <= end; i += FVec::size()) {
    FVec w = FVec::loadu(w_ptr + i), g(0.f), m(0.f), v(0.f);
    if (Op::kGrad) g = FVec::loadu(g_ptr + i) * gm;
    if (Op::kM) m = FVec::loadu(p.exp_avg + i);
    if (Op::kV) v = FVec::loadu(p.exp_avg_sq + i);
    op(w, g, m, v);
    if (Op::kWriteState) {
      if (Op::kM) m.store(p.exp_avg + i);
      if (Op::kV) v.store(p.exp_avg_sq + i);
    }
    if (Op::kWriteW) w.store(w_ptr + i);
  }
  for (; i < end; ++i) scalar_element<float>(p, i, op);
}

template <class Op>
void run_bf16(const FusedParam& p, int64_t begin, int64_t end, Op& op) {
  constexpr int64_t kF = FVec::size();
  constexpr int64_t kB = BVec::size();  // 2 * kF
  auto* param = static_cast<c10::BFloat16*>(p.param);
  const auto* grad = static_cast<const c10::BFloat16*>(p.grad);
  const FVec gm(p.grad_mul);
  int64_t i = begin;
  for (; i + kB <= end; i += kB) {
    FVec g0(0.f), g1(0.f), w0, w1, m0(0.f), m1(0.f), v0(0.f), v1(0.f);
    if (Op::kGrad) {
      std::tie(g0, g1) = at::vec::convert_bfloat16_float(BVec::loadu(grad + i));
      g0 = g0 * gm;
      g1 = g1 * gm;
    }
    if (p.master) {  // bf16 param, fp32 master: the param is write-only
      w0 = FVec::loadu(p.master + i);
      w1 = FVec::loadu(p.master + i + kF);
    } else {
      std::tie(w0, w1) = at::vec::convert_bfloat16_float(BVec::loadu(param + i));
    }
    if (Op::kM) {
      m0 = FVec::loadu(p.exp_avg + i);
      m1 = FVec::loadu(p.exp_avg + i + kF);
    }
    if (Op::kV) {
      v0 = FVec::loadu(p.exp_avg_sq + i);
      v1 = FVec::loadu(p.exp_avg_sq + i + kF);
    }
    op(w0, g0, m0, v0);
    op(w1, g1, m1, v1);
    if (Op::kWriteState) {
      if (Op::kM) {
        m0.store(p.exp_avg + i);
        m1.store(p.exp_avg + i + kF);
      }
      if (Op::kV) {
        v0.store(p.exp_avg_sq + i);
        v1.store(p.exp_avg_sq + i + kF);
      }
    }
    if (Op::kWriteW) {
      if (p.master) {
        w0.store(p.master + i);
        w1.store(p.master + i + kF);
      }
      if (p.stochastic_rounding) {
        float tmp[kB];
        w0.store(tmp);
        w1.store(tmp + kF);
        for (int64_t k = 0; k < kB; ++k) param[i + k] = round_stochastic(tmp[k], p.rng_key, i + k);
      } else {
        at::vec::convert_float_bfloat16(w0, w1).store(param + i);
      }
    }
  }
  for (; i < end; ++i) scalar_element<c10::BFloat16>(p, i, op);
}

template <class Op>
void run(const FusedParam& p, int64_t begin, int64_t end, Op& op) {
  switch (p.dtype) {
    case c10::kFloat:
      run_float(p, begin, end, op);
      break;
    case c10::kBFloat16:
      run_bf16(p, begin, end, op);
      break;
    case c10::kHalf:
      for (int64_t i = begin; i < end; ++i) scalar_element<c10::Half>(p, i, op);
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "unreachable: dtype checked by the driver");
  }
}

// The updates themselves (kernels/optim_math.h, shared with CUDA).
using math::AdamWOp;
using math::LambApplyOp;
using math::LambDir;
using math::SgdOp;

struct LambMomentsOp {
  static constexpr bool kGrad = true, kM = true, kV = true, kWriteW = false, kWriteState = true;
  float b1, omb1, b2, omb2;
  LambDir dir;
  FVec acc_w{0.f}, acc_u{0.f};
  float sacc_w = 0.f, sacc_u = 0.f;
  void accumulate(const FVec& w, const FVec& u) {
    acc_w = acc_w + w * w;
    acc_u = acc_u + u * u;
  }
  void accumulate(float w, float u) {
    sacc_w += w * w;
    sacc_u += u * u;
  }
  template <class V>
  void operator()(V& w, V g, V& m, V& v) {
    math::lamb_moments(g, m, v, b1, omb1, b2, omb2);
    accumulate(w, dir(w, m, v));
  }
};

}  // namespace

void adamw_span(const FusedParam& p, int64_t begin, int64_t end) {
  AdamWOp op{p.decay_factor,          p.beta1, p.one_minus_beta1, p.beta2, p.one_minus_beta2,
             p.bias_correction2_sqrt, p.eps,   -p.step_size};
  run(p, begin, end, op);
}

void sgd_span(const FusedParam& p, int64_t begin, int64_t end) {
  if (p.exp_avg) {
    SgdOp<true> op{p.weight_decay, p.momentum, p.one_minus_dampening,
                   -p.lr,          p.nesterov, p.first_step};
    run(p, begin, end, op);
  } else {
    SgdOp<false> op{p.weight_decay, 0.f, 1.f, -p.lr, false, false};
    run(p, begin, end, op);
  }
}

void lamb_moments_span(const FusedParam& p, int64_t begin, int64_t end, double* sums) {
  const LambDir dir{p.bias_correction1, p.bias_correction2, p.eps, p.weight_decay};
  // fp32 lane accumulators over at most 4096 elements, then double.
  constexpr int64_t kBlock = 4096;
  for (int64_t b = begin; b < end; b += kBlock) {
    LambMomentsOp op{p.beta1, p.one_minus_beta1, p.beta2, p.one_minus_beta2, dir};
    run(p, b, std::min(b + kBlock, end), op);
    sums[0] += lane_sum<double>(op.acc_w) + op.sacc_w;
    sums[1] += lane_sum<double>(op.acc_u) + op.sacc_u;
  }
}

void lamb_apply_span(const FusedParam& p, int64_t begin, int64_t end) {
  LambApplyOp op{{p.bias_correction1, p.bias_correction2, p.eps, p.weight_decay}, -p.step_size};
  run(p, begin, end, op);
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
