#include "ampx/optim/lamb.h"

#include "cpu_driver.h"
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

void LAMB::update_cpu(std::vector<detail::ParamWork>& work, float grad_mul) {
  std::vector<detail::FusedParam> fused;
  std::vector<int64_t> numels;
  for (const auto& w : work) {
    const auto& o = static_cast<const LAMBOptions&>(param_groups_[w.group].options());
    const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
    const auto step = static_cast<double>(w.state->step);
    auto p = detail::fused_operands(w, config(), grad_mul);
    detail::set_adam_moments(p, b1, b2, o.eps());
    p.weight_decay = static_cast<float>(o.weight_decay());
    const auto s = ampx::detail::math::lamb_scalars(b1, b2, step);
    p.bias_correction1 = s.bc1;
    p.bias_correction2 = s.bc2;
    fused.push_back(p);
    numels.push_back(w.param.numel());
  }
  const auto& k = detail::optim_kernels();
  // Pass 1: moments, and per-chunk sums of w^2 and u^2 (summed per tensor in
  // chunk order afterwards, so the norms do not depend on the thread count).
  const auto chunks = detail::make_chunks(numels, detail::kChunkElems);
  std::vector<double> sums(2 * chunks.size(), 0.0);
  detail::for_each_chunk(numels, detail::kChunkElems,
                         [&](int64_t c, int64_t i, int64_t b, int64_t e) {
                           k.lamb_moments(fused[i], b, e, &sums[2 * c]);
                         });
  std::vector<double> w_sq(fused.size(), 0.0), u_sq(fused.size(), 0.0);
  for (size_t c = 0; c < chunks.size(); ++c) {
    w_sq[chunks[c].tensor] += sums[2 * c];
    u_sq[chunks[c].tensor] += sums[2 * c + 1];
  }
  for (size_t i = 0; i < fused.size(); ++i) {
    const auto& o = static_cast<const LAMBOptions&>(param_groups_[work[i].group].options());
    fused[i].step_size =
        static_cast<float>(o.lr() * ampx::detail::math::lamb_trust_ratio(w_sq[i], u_sq[i]));
  }
  // Pass 2: w -= lr * ratio * u, u recomputed from the new moments.
  detail::for_each_chunk(
      numels, detail::kChunkElems,
      [&](int64_t, int64_t i, int64_t b, int64_t e) { k.lamb_apply(fused[i], b, e); });
}

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
