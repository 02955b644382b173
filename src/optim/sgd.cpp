#include "ampx/optim/sgd.h"

#include "fused/fused_step.h"
#include "options_checks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace ampx {
namespace optim {
namespace {

void check(const SGDOptions& o) {
  TORCH_CHECK(o.lr() >= 0, "ampx::optim::SGD: lr must be >= 0, got ", o.lr());
  TORCH_CHECK(o.momentum() >= 0, "ampx::optim::SGD: momentum must be >= 0, got ", o.momentum());
  TORCH_CHECK(o.weight_decay() >= 0, "ampx::optim::SGD: weight_decay must be >= 0, got ",
              o.weight_decay());
  TORCH_CHECK(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0),
              "ampx::optim::SGD: nesterov needs momentum > 0 and dampening 0, got momentum ",
              o.momentum(), ", dampening ", o.dampening());
}

}  // namespace

SGDOptions::SGDOptions(double lr) : lr_(lr) {}

SGD::SGD(std::vector<torch::optim::OptimizerParamGroup> param_groups, SGDOptions defaults)
    : MixedPrecisionOptimizer(std::move(param_groups), std::make_unique<SGDOptions>(defaults),
                              detail::config_of(defaults)) {
  check(defaults);
}

SGD::SGD(std::vector<at::Tensor> params, SGDOptions defaults)
    : SGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

bool SGD::uses_exp_avg(const torch::optim::OptimizerOptions& group) const {
  return static_cast<const SGDOptions&>(group).momentum() != 0;
}

detail::FusedOptions SGD::fused_options(size_t group) const {
  const auto& o = static_cast<const SGDOptions&>(param_groups_[group].options());
  detail::FusedOptions f;
  f.update = detail::FusedUpdate::kSgd;
  f.lr = o.lr();
  f.weight_decay = o.weight_decay();
  f.momentum = o.momentum();
  f.dampening = o.dampening();
  f.nesterov = o.nesterov() ? 1 : 0;
  return f;
}

void SGD::update_generic(detail::ParamWork& w, const at::Tensor& grad, const at::Tensor& skip) {
  const auto& o = static_cast<const SGDOptions&>(param_groups_[w.group].options());
  auto& st = *w.state;
  auto weight = weight_f32(w);
  auto d = grad;
  if (o.weight_decay() != 0) {
    d = d + weight * o.weight_decay();
  }
  if (o.momentum() != 0) {
    const auto buf = st.exp_avg_fresh ? d : st.exp_avg * o.momentum() + d * (1 - o.dampening());
    commit(st.exp_avg, buf, skip);
    d = o.nesterov() ? d + buf * o.momentum() : buf;
  }
  write_weight(w, weight + d * (-o.lr()), skip);
}

}  // namespace optim
}  // namespace ampx
