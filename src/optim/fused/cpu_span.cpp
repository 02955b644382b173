// The fused optimizer step's CPU spans, compiled once per instruction set
// (cpu_kernels.h). One span = elements [begin, end) of one param; each
// operand is loaded once and stored once:
//   grad  (param dtype)  -> widened to fp32, multiplied by grad_mul
//   weight (fp32 master, or the param widened)
//   exp_avg, exp_avg_sq (fp32)
// The update is built from the param's options as the CUDA kernels build it
// (fused_step.h). bf16 goes through at::vec's bf16 <-> fp32 conversions
// (round to nearest even on the way back); fp16 runs per element (LibTorch
// 1.13 has no Half vectorization). Vector and scalar code evaluate the same
// float expressions in the same order without FMA contraction, so tails
// match vector lanes.

#include "cpu_kernels.h"

#include "../../kernels/isa/vec_math.h"

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

namespace fused = ::ampx::optim::detail;
using at::vec::Vectorized;
using FVec = Vectorized<float>;
using BVec = Vectorized<c10::BFloat16>;

// One element (the vector loops' tails; fp16 throughout): the shared
// update_element (optim_math.h), as the CUDA kernels run it.
template <class T, class Op>
inline void scalar_element(const FusedParam& p, const FusedAt& at, int64_t i, const Op& op) {
  math::update_element<T>(p, i, at.grad_mul, op, fused::narrow_for<T>(p, at));
}

template <class Op>
void run_float(const FusedParam& p, const FusedAt& at, int64_t begin, int64_t end, const Op& op) {
  float* w_ptr = static_cast<float*>(p.param);
  const float* g_ptr = static_cast<const float*>(p.grad);
  const FVec gm(at.grad_mul);
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
  for (; i < end; ++i) scalar_element<float>(p, at, i, op);
}

template <class Op>
void run_bf16(const FusedParam& p, const FusedAt& at, int64_t begin, int64_t end, const Op& op) {
  constexpr int64_t kF = FVec::size();
  constexpr int64_t kB = BVec::size();  // 2 * kF
  auto* param = static_cast<c10::BFloat16*>(p.param);
  const auto* grad = static_cast<const c10::BFloat16*>(p.grad);
  const auto narrow = fused::narrow_for<c10::BFloat16>(p, at);
  const FVec gm(at.grad_mul);
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
      if (narrow.stochastic) {
        float tmp[kB];
        w0.store(tmp);
        w1.store(tmp + kF);
        for (int64_t k = 0; k < kB; ++k) param[i + k] = narrow(tmp[k], i + k);
      } else {
        at::vec::convert_float_bfloat16(w0, w1).store(param + i);
      }
    }
  }
  for (; i < end; ++i) scalar_element<c10::BFloat16>(p, at, i, op);
}

template <class Op>
void run(const FusedParam& p, const FusedAt& at, int64_t begin, int64_t end, const Op& op) {
  switch (p.dtype) {
    case fused::FusedDtype::kFloat:
      run_float(p, at, begin, end, op);
      break;
    case fused::FusedDtype::kBFloat16:
      run_bf16(p, at, begin, end, op);
      break;
    case fused::FusedDtype::kHalf:
      for (int64_t i = begin; i < end; ++i) scalar_element<c10::Half>(p, at, i, op);
      break;
  }
}

// LAMB's sums of w^2 and u^2: fp32 lane accumulators over a block, then double.
struct LambSums {
  FVec w{0.f}, u{0.f};
  float sw = 0.f, su = 0.f;
  void add(const FVec& wv, const FVec& uv) {
    w = w + wv * wv;
    u = u + uv * uv;
  }
  void add(float wv, float uv) {
    sw += wv * wv;
    su += uv * uv;
  }
};

}  // namespace

void update_span(const FusedParam& p, const FusedAt& at, int64_t begin, int64_t end) {
  switch (p.options.update) {
    case fused::FusedUpdate::kAdamW:
      run(p, at, begin, end, fused::adamw_op(p.options, at.step));
      break;
    case fused::FusedUpdate::kSgd:
      if (fused::sgd_has_momentum(p)) {
        run(p, at, begin, end, fused::sgd_momentum_op(p));
      } else {
        run(p, at, begin, end, fused::sgd_plain_op(p.options));
      }
      break;
    case fused::FusedUpdate::kLamb:
      TORCH_INTERNAL_ASSERT(false, "LAMB runs as lamb_moments_span and lamb_apply_span");
  }
}

void lamb_moments_span(const FusedParam& p, const FusedAt& at, int64_t begin, int64_t end,
                       double* sums) {
  // fp32 lane accumulators over at most 4096 elements, then double.
  constexpr int64_t kBlock = 4096;
  for (int64_t b = begin; b < end; b += kBlock) {
    LambSums acc;
    run(p, at, b, std::min(b + kBlock, end), fused::lamb_moments_op(p.options, at.step, &acc));
    sums[0] += lane_sum<double>(acc.w) + acc.sw;
    sums[1] += lane_sum<double>(acc.u) + acc.su;
  }
}

void lamb_apply_span(const FusedParam& p, const FusedAt& at, float neg_step, int64_t begin,
                     int64_t end) {
  run(p, at, begin, end, fused::lamb_apply_op(p.options, at.step, neg_step));
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
