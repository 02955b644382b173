#pragma once

// A fused optimizer step, described once for both devices. The CPU span
// kernels (cpu_span.cpp, once per instruction set) and the CUDA multi-tensor
// kernels (cuda_step.cu) read the same FusedParam, build their update from
// it with the same functions below, and run it element by element with the
// same arithmetic (optim_math.h). Only the loops differ: vector lanes and
// 64K-element chunks on the CPU, a thread block per chunk on the GPU.
//
// Everything here is plain data and __host__ __device__ code, without
// LibTorch's tensors: the driver (cpu_step.h, ../optimizer.cpp) fills it.

#include "optim_math.h"

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

namespace ampx {
namespace optim {
namespace detail {

namespace math = ::ampx::detail::math;

/// The update a fused step runs.
enum class FusedUpdate : int32_t { kAdamW = 0, kSgd = 1, kLamb = 2 };

/// A param's dtype as the kernels name it (the CUDA step launches per dtype).
enum class FusedDtype : int32_t { kFloat = 0, kBFloat16 = 1, kHalf = 2 };
constexpr int kFusedDtypes = 3;

/// One param group's options, as given (in double): each kernel derives its
/// float operands from them the same way (the *_op functions below).
struct FusedOptions {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  double momentum = 0, dampening = 0;
  FusedUpdate update = FusedUpdate::kAdamW;
  int32_t nesterov = 0;
};

/// How a param's moments are stored (ampx::optim::StateFormat's values).
enum class FusedState : int32_t { kFp32 = 0, kBf16 = 1, kFp8 = 2, kInt8 = 3 };

/// One param of a fused step, on either device: its operands (pointers into
/// the param's own memory, CPU or CUDA), its group's options and where it
/// stands among all params. Plain data without padding bytes: the CUDA step
/// compares a step's operands with the last one's byte for byte.
///
/// The moments are fp32 (exp_avg, exp_avg_sq) or, for a state format of
/// fewer bits, codes (exp_avg_codes, exp_avg_sq_codes: bf16, or FP8 / 8-bit
/// codes with an fp32 scale per block of state_block elements); a bf16 or
/// fp16 param without master may carry a Kahan compensation of its dtype.
/// The CPU runs such params in tiles (cpu_span.cpp): each tile's moments and
/// weight decoded into fp32 buffers, the fp32 update run on a FusedParam that
/// points at them (index_base: where the tile starts in the whole param),
/// the buffers encoded back; the CUDA step runs the same tiles in shared
/// memory, a thread block a tile at a time (AdamW and SGD; not LAMB).
struct FusedParam {
  void* param = nullptr;        // fp32, bf16 or fp16, contiguous
  float* master = nullptr;      // fp32 master, or null (fp32 param / no masters)
  const void* grad = nullptr;   // the param's dtype, contiguous
  float* exp_avg = nullptr;     // fp32 first moment / momentum buffer, or null
  float* exp_avg_sq = nullptr;  // fp32 second moment, or null
  void* exp_avg_codes = nullptr;     // first moment in state_format's codes, or null
  void* exp_avg_sq_codes = nullptr;  // second moment in state_format's codes, or null
  float* exp_avg_scale = nullptr;    // FP8 / 8-bit: a scale per block, or null
  float* exp_avg_sq_scale = nullptr;
  void* compensation = nullptr;  // Kahan: the weight's lost low bits, the param's dtype, or null
  int64_t numel = 0;
  int64_t position = 0;    // index over all groups, in order: stochastic rounding's key
  int64_t index_base = 0;  // element 0's index in the whole param (a CPU tile's start)
  FusedOptions options;
  FusedDtype dtype = FusedDtype::kFloat;
  int32_t stochastic_rounding = 0;  // bf16 params without master only
  int32_t exp_avg_fresh = 0;        // SGD: the buffer starts as d (ParamState::exp_avg_fresh)
  FusedState state_format = FusedState::kFp32;  // of the *_codes moments
  int32_t state_block = 0;                      // FP8 / 8-bit: elements per scale
  int32_t unused = 0;                           // (no padding bytes: compared byte for byte)
};
static_assert(sizeof(FusedOptions) == 7 * sizeof(double) + 2 * sizeof(int32_t),
              "FusedOptions must have no padding");
static_assert(sizeof(FusedParam) == 10 * sizeof(void*) + 3 * sizeof(int64_t) +
                                        sizeof(FusedOptions) + 6 * sizeof(int32_t),
              "FusedParam must have no padding");

/// Whether a param's moments or weight need the CPU's tiles (low-bit state, Kahan).
AMPX_HD bool fused_tiled(const FusedParam& p) {
  return p.exp_avg_codes != nullptr || p.exp_avg_sq_codes != nullptr || p.compensation != nullptr;
}

/// The elements of a tile of a tiled param: 256, or one block where a block
/// format's blocks are larger, so that a tile holds whole blocks (the CPU's
/// tiles, cpu_span.cpp, and the CUDA step's, cuda_step.cu). (Measured with
/// ampx_optim_bench on the CPU, Kahan weights, bf16 or 8-bit moments: tiles
/// of 1024 ran 25-30% slower than tiles of 256.)
constexpr int64_t kFusedTile = 256;
AMPX_HD int64_t fused_tile(const FusedParam& p) {
  const bool blocks = (p.state_format == FusedState::kFp8 || p.state_format == FusedState::kInt8) &&
                      (p.exp_avg_codes != nullptr || p.exp_avg_sq_codes != nullptr);
  return blocks && p.state_block > kFusedTile ? p.state_block : kFusedTile;
}

/// Where a param's update stands in this step, the same on both devices:
/// `step` counts this step (1 at the first), `grad_mul` is 1 / scale times
/// the clip coefficient, `key` stochastic rounding's (seed, step, position).
struct FusedAt {
  double step;
  float grad_mul;
  uint64_t key;
};
AMPX_HD FusedAt fused_at(const FusedParam& p, double step, float grad_mul, uint64_t seed) {
  return {step, grad_mul, math::sr_key(seed, static_cast<int64_t>(step), p.position)};
}

/// The param's new element from the fp32 weight: nearest even, or for a
/// bf16 param under stochastic rounding, unbiased random rounding whose bits
/// depend only on (key, element of the whole param).
template <class T>
struct Narrow {
  bool stochastic;
  uint64_t key;
  int64_t index_base;  // element i's index in the whole param: index_base + i
  AMPX_HD T operator()(float w, int64_t i) const {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (stochastic) {
        return c10::BFloat16(math::bf16_bits_stochastic(w, math::sr_bits(key, index_base + i)),
                             c10::BFloat16::from_bits());
      }
    }
    return static_cast<T>(w);
  }
};
template <class T>
AMPX_HD Narrow<T> narrow_for(const FusedParam& p, const FusedAt& at) {
  return {p.stochastic_rounding != 0, at.key, p.index_base};
}

// --- each update's per-element op, from the options and the step ---------
// Scalars in double as LibTorch computes them, each rounded to float once.

AMPX_HD math::AdamWOp adamw_op(const FusedOptions& o, double step) {
  const auto s = math::adamw_scalars(o.lr, o.beta1, o.beta2, o.weight_decay, step);
  return {s.decay,
          static_cast<float>(o.beta1),
          static_cast<float>(1 - o.beta1),
          static_cast<float>(o.beta2),
          static_cast<float>(1 - o.beta2),
          s.bc2_sqrt,
          static_cast<float>(o.eps),
          -s.step_size};
}

/// Whether an SGD param keeps a momentum buffer this step: the driver
/// (fused_param) leaves exp_avg null when its group has no momentum, even if
/// a group that had momentum left a buffer.
AMPX_HD bool sgd_has_momentum(const FusedParam& p) {
  return p.exp_avg != nullptr;
}
/// LibTorch's buffer := d at its first use (exp_avg_fresh), which is not
/// always the param's first step.
AMPX_HD math::SgdOp<true> sgd_momentum_op(const FusedParam& p) {
  const FusedOptions& o = p.options;
  return {static_cast<float>(o.weight_decay),
          static_cast<float>(o.momentum),
          static_cast<float>(1 - o.dampening),
          static_cast<float>(-o.lr),
          o.nesterov != 0,
          p.exp_avg_fresh != 0};
}
AMPX_HD math::SgdOp<false> sgd_plain_op(const FusedOptions& o) {
  return {static_cast<float>(o.weight_decay), 0.f, 1.f, static_cast<float>(-o.lr), false, false};
}

AMPX_HD math::LambDir lamb_dir(const FusedOptions& o, double step) {
  const auto s = math::lamb_scalars(o.beta1, o.beta2, step);
  return {s.bc1, s.bc2, static_cast<float>(o.eps), static_cast<float>(o.weight_decay)};
}
/// LAMB's first pass, adding w^2 and u^2 to *acc.
template <class Acc>
AMPX_HD math::LambMomentsOp<Acc> lamb_moments_op(const FusedOptions& o, double step, Acc* acc) {
  return {static_cast<float>(o.beta1), static_cast<float>(1 - o.beta1),
          static_cast<float>(o.beta2), static_cast<float>(1 - o.beta2),
          lamb_dir(o, step),           acc};
}
/// -lr * trust ratio, from the param's sums of w^2 and u^2 over all its chunks.
AMPX_HD float lamb_neg_step(const FusedOptions& o, double w_sq, double u_sq) {
  return static_cast<float>(-(o.lr * math::lamb_trust_ratio(w_sq, u_sq)));
}
/// LAMB's second pass: w += neg_step * u, u recomputed from the new moments.
AMPX_HD math::LambApplyOp lamb_apply_op(const FusedOptions& o, double step, float neg_step) {
  return {lamb_dir(o, step), neg_step};
}

}  // namespace detail
}  // namespace optim
}  // namespace ampx
