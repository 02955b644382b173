#include "ampx/optim/adamw.h"

#include "fused/fused_step.h"
#include "options_checks.h"
#include "sqrt_rounded.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace ampx {
namespace optim {

AdamWOptions::AdamWOptions(double lr) : lr_(lr) {}

AdamW::AdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups, AdamWOptions defaults)
    : MixedPrecisionOptimizer(std::move(param_groups), std::make_unique<AdamWOptions>(defaults),
                              detail::config_of(defaults)) {
  detail::check_adam_family(defaults, "AdamW");
}

AdamW::AdamW(std::vector<at::Tensor> params, AdamWOptions defaults)
    : AdamW({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

detail::FusedOptions AdamW::fused_options(size_t group) const {
  return detail::adam_family_fused_options(
      static_cast<const AdamWOptions&>(param_groups_[group].options()),
      detail::FusedUpdate::kAdamW);
}

void AdamW::update_generic(detail::ParamWork& w, const at::Tensor& grad, const at::Tensor& skip) {
  const auto& o = static_cast<const AdamWOptions&>(param_groups_[w.group].options());
  const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
  auto& st = *w.state;
  const auto& step = st.step_t;  // float64 [], this step counted
  const auto step_size = (o.lr() / (1 - at::pow(b1, step))).to(at::kFloat);
  const auto bc2_sqrt = (1 - at::pow(b2, step)).sqrt().to(at::kFloat);
  auto weight = weight_f32(w) * (1 - o.lr() * o.weight_decay());
  const auto m = st.exp_avg * b1 + grad * (1 - b1);
  const auto v = st.exp_avg_sq * b2 + grad * (1 - b2) * grad;  // as the kernels: (1-b2)*g*g
  weight = weight - step_size * m / (detail::sqrt_rounded_once(v) / bc2_sqrt + o.eps());
  commit(st.exp_avg, m, skip);
  commit(st.exp_avg_sq, v, skip);
  write_weight(w, weight, skip);
}

}  // namespace optim
}  // namespace ampx
