#pragma once

// What the optimizers share: the mixed-precision switches every options
// struct carries, Adam-family options for the fused step, and the checks
// of Adam-family hyper-parameters.

#include "ampx/optim/optimizer.h"

#include "fused/fused_step.h"

#include <c10/util/Exception.h>

#include <tuple>

namespace ampx {
namespace optim {
namespace detail {

template <class Options>
MixedPrecisionConfig config_of(const Options& o) {
  MixedPrecisionConfig c;
  c.master_weights = o.master_weights();
  c.stochastic_rounding = o.stochastic_rounding();
  c.seed = o.seed();
  c.max_grad_norm = o.max_grad_norm();
  c.kahan_summation = o.kahan_summation();
  c.state_format = o.state_format();
  c.state_block = o.state_block();
  c.state_min_numel = o.state_min_numel();
  return c;
}

/// AdamW's and LAMB's options as the fused step reads them.
template <class Options>
FusedOptions adam_family_fused_options(const Options& o, FusedUpdate update) {
  FusedOptions f;
  f.update = update;
  f.lr = o.lr();
  f.beta1 = std::get<0>(o.betas());
  f.beta2 = std::get<1>(o.betas());
  f.eps = o.eps();
  f.weight_decay = o.weight_decay();
  return f;
}

/// lr, eps, betas and weight_decay of AdamW and LAMB; `who` names the optimizer.
template <class Options>
void check_adam_family(const Options& o, const char* who) {
  TORCH_CHECK(o.lr() >= 0, "ampx::optim::", who, ": lr must be >= 0, got ", o.lr());
  TORCH_CHECK(o.eps() >= 0, "ampx::optim::", who, ": eps must be >= 0, got ", o.eps());
  const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
  TORCH_CHECK(b1 >= 0 && b1 < 1, "ampx::optim::", who, ": betas[0] must be in [0, 1), got ", b1);
  TORCH_CHECK(b2 >= 0 && b2 < 1, "ampx::optim::", who, ": betas[1] must be in [0, 1), got ", b2);
  TORCH_CHECK(o.weight_decay() >= 0, "ampx::optim::", who, ": weight_decay must be >= 0, got ",
              o.weight_decay());
}

}  // namespace detail
}  // namespace optim
}  // namespace ampx
