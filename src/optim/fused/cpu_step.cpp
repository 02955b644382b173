#include "cpu_step.h"

#include "../../kernels/cpu/chunks.h"
#include "cpu_kernels.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace ampx {
namespace optim {
namespace detail {

namespace cpu = ::ampx::detail::cpu;

static_assert(static_cast<int32_t>(StateFormat::kBf16) == static_cast<int32_t>(FusedState::kBf16) &&
                  static_cast<int32_t>(StateFormat::kFp8) ==
                      static_cast<int32_t>(FusedState::kFp8) &&
                  static_cast<int32_t>(StateFormat::kInt8) ==
                      static_cast<int32_t>(FusedState::kInt8),
              "the kernels' state formats are ampx::optim::StateFormat's");

FusedDtype fused_dtype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      return FusedDtype::kFloat;
    case c10::kBFloat16:
      return FusedDtype::kBFloat16;
    case c10::kHalf:
      return FusedDtype::kHalf;
    default:
      TORCH_CHECK(false, "ampx::optim: the fused step takes Float, BFloat16 and Half params, got ",
                  dtype);
  }
}

FusedParam fused_param(const ParamWork& work, const FusedOptions& options,
                       const MixedPrecisionConfig& config) {
  const auto& st = *work.state;
  FusedParam p;
  p.param = work.param.data_ptr();
  p.grad = work.grad.data_ptr();
  p.master = st.master.defined() ? st.master.data_ptr<float>() : nullptr;
  // (SGD without momentum: a buffer left from a group that had it is not used.)
  const bool momentum = options.update != FusedUpdate::kSgd || options.momentum != 0;
  // Moments in fp32, or codes (config.state_format) with their block scales.
  bool coded = false;
  if (st.exp_avg.defined() && momentum) {
    if (st.exp_avg.scalar_type() == c10::kFloat) {
      p.exp_avg = st.exp_avg.data_ptr<float>();
    } else {
      p.exp_avg_codes = st.exp_avg.data_ptr();
      p.exp_avg_scale = st.exp_avg_scale.defined() ? st.exp_avg_scale.data_ptr<float>() : nullptr;
      coded = true;
    }
  }
  if (st.exp_avg_sq.defined()) {
    if (st.exp_avg_sq.scalar_type() == c10::kFloat) {
      p.exp_avg_sq = st.exp_avg_sq.data_ptr<float>();
    } else {
      p.exp_avg_sq_codes = st.exp_avg_sq.data_ptr();
      p.exp_avg_sq_scale =
          st.exp_avg_sq_scale.defined() ? st.exp_avg_sq_scale.data_ptr<float>() : nullptr;
      coded = true;
    }
  }
  if (coded) {
    p.state_format = static_cast<FusedState>(config.state_format);
    p.state_block = static_cast<int32_t>(config.state_block);
  }
  p.compensation = st.compensation.defined() ? st.compensation.data_ptr() : nullptr;
  p.exp_avg_fresh = (p.exp_avg != nullptr || p.exp_avg_codes != nullptr) && st.exp_avg_fresh;
  p.numel = work.param.numel();
  p.position = work.position;
  p.options = options;
  p.dtype = fused_dtype(work.param.scalar_type());
  p.stochastic_rounding =
      config.stochastic_rounding && p.dtype == FusedDtype::kBFloat16 && p.master == nullptr;
  return p;
}

namespace {

// The span kernels of the best instruction set this CPU runs.
const cpu::OptimKernels& optim_kernels() {
  static const cpu::OptimKernels kernels = cpu::optim_kernels_for(cpu::best_isa());
  return kernels;
}

}  // namespace

void cpu_step(const std::vector<FusedParam>& params, const std::vector<int64_t>& steps,
              float grad_mul, uint64_t seed, const WholeSums* whole_sums) {
  TORCH_INTERNAL_ASSERT(params.size() == steps.size());
  if (params.empty()) return;
  const auto update = params[0].options.update;
  std::vector<int64_t> numels;
  std::vector<FusedAt> at;
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_INTERNAL_ASSERT(params[i].options.update == update);
    numels.push_back(params[i].numel);
    at.push_back(fused_at(params[i], static_cast<double>(steps[i]), grad_mul, seed));
  }
  const auto& k = optim_kernels();
  if (update != FusedUpdate::kLamb) {
    cpu::for_each_chunk(numels, cpu::kChunkElems, [&](int64_t, int64_t i, int64_t b, int64_t e) {
      k.update(params[i], at[i], b, e);
    });
    return;
  }
  // LAMB. Pass 1: moments, and per-chunk sums of w^2 and u^2 (summed per
  // param in chunk order afterwards, so the norms do not depend on the
  // thread count).
  const auto chunks = cpu::make_chunks(numels, cpu::kChunkElems);
  std::vector<double> sums(2 * chunks.size(), 0.0);
  cpu::for_each_chunk(numels, cpu::kChunkElems, [&](int64_t c, int64_t i, int64_t b, int64_t e) {
    k.lamb_moments(params[i], at[i], b, e, &sums[2 * c]);
  });
  std::vector<double> w_sq(params.size(), 0.0), u_sq(params.size(), 0.0);
  for (size_t c = 0; c < chunks.size(); ++c) {
    w_sq[chunks[c].tensor] += sums[2 * c];
    u_sq[chunks[c].tensor] += sums[2 * c + 1];
  }
  if (whole_sums != nullptr) (*whole_sums)(w_sq, u_sq);
  std::vector<float> neg_steps(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    neg_steps[i] = lamb_neg_step(params[i].options, w_sq[i], u_sq[i]);
  }
  // Pass 2: w -= lr * ratio * u, u recomputed from the new moments.
  cpu::for_each_chunk(numels, cpu::kChunkElems, [&](int64_t, int64_t i, int64_t b, int64_t e) {
    k.lamb_apply(params[i], at[i], neg_steps[i], b, e);
  });
}

}  // namespace detail
}  // namespace optim
}  // namespace ampx
