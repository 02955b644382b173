#include "cpu_driver.h"

#include <ATen/ATen.h>

namespace ampx {
namespace optim {
namespace detail {

FusedParam fused_operands(const ParamWork& work, const MixedPrecisionConfig& config,
                          float grad_mul) {
  FusedParam p;
  const auto& st = *work.state;
  p.param = work.param.data_ptr();
  p.grad = work.grad.data_ptr();
  p.master = st.master.defined() ? st.master.data_ptr<float>() : nullptr;
  p.exp_avg = st.exp_avg.defined() ? st.exp_avg.data_ptr<float>() : nullptr;
  p.exp_avg_sq = st.exp_avg_sq.defined() ? st.exp_avg_sq.data_ptr<float>() : nullptr;
  p.dtype = work.param.scalar_type();
  p.stochastic_rounding = config.stochastic_rounding && p.dtype == at::kBFloat16 && !p.master;
  p.rng_key = cpu::sr_key(config.seed, st.step, work.position);
  p.grad_mul = grad_mul;
  return p;
}

const cpu::OptimKernels& optim_kernels() {
  static const cpu::OptimKernels kernels = cpu::optim_kernels_for(cpu::best_isa());
  return kernels;
}

}  // namespace detail
}  // namespace optim
}  // namespace ampx
