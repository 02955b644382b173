#include "ampx/optim/lamb.h"

#include "fused/fused_step.h"
#include "options_checks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace ampx {
namespace optim {

LAMBOptions::LAMBOptions(double lr) : lr_(lr) {}

LAMB::LAMB(std::vector<torch::optim::OptimizerParamGroup> param_groups, LAMBOptions defaults)
    : MixedPrecisionOptimizer(std::move(param_groups), std::make_unique<LAMBOptions>(defaults),
                              detail::config_of(defaults)) {
  detail::check_adam_family(defaults, "LAMB");
}

LAMB::LAMB(std::vector<at::Tensor> params, LAMBOptions defaults)
    : LAMB({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

detail::FusedOptions LAMB::fused_options(size_t group) const {
  return detail::adam_family_fused_options(
      static_cast<const LAMBOptions&>(param_groups_[group].options()), detail::FusedUpdate::kLamb);
}

void LAMB::update_generic(detail::ParamWork& w, const at::Tensor& grad, const at::Tensor& skip) {
  const auto& o = static_cast<const LAMBOptions&>(param_groups_[w.group].options());
  const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
  auto& st = *w.state;
  const auto bc1 = (1 - at::pow(b1, st.step_t)).to(at::kFloat);
  const auto bc2 = (1 - at::pow(b2, st.step_t)).to(at::kFloat);
  const auto weight = weight_f32(w);
  const auto m = st.exp_avg * b1 + grad * (1 - b1);
  const auto v = st.exp_avg_sq * b2 + grad * (1 - b2) * grad;  // as the kernels: (1-b2)*g*g
  const auto u = (m / bc1) / ((v / bc2).sqrt() + o.eps()) + weight * o.weight_decay();
  const auto w_norm = weight.norm();
  const auto u_norm = u.norm();
  const auto ratio =
      at::where(w_norm.gt(0).logical_and(u_norm.gt(0)), w_norm / u_norm, at::ones_like(w_norm));
  commit(st.exp_avg, m, skip);
  commit(st.exp_avg_sq, v, skip);
  write_weight(w, weight - (o.lr() * ratio) * u, skip);
}

}  // namespace optim
}  // namespace ampx
