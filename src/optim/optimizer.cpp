// MixedPrecisionOptimizer's step driver: gathers params with grads, decides
// skip / unscale / clip once per step, sets up masters and states, then hands
// dense CPU params to the fused CPU kernels, dense CUDA params to the fused
// CUDA kernels (fused/cuda_step.h, where built with CUDA), both reading the
// same description of the step (fused/fused_step.h), and everything else to
// ATen ops.

#include "ampx/optim/optimizer.h"

#include "../scaler/scale_math.h"
#include "fused/cpu_step.h"
#include "fused/cuda_step.h"
#include "fused/state_tiles.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

namespace ampx {
namespace optim {

using detail::ParamState;
using detail::ParamWork;

MixedPrecisionOptimizer::MixedPrecisionOptimizer(
    std::vector<torch::optim::OptimizerParamGroup> param_groups,
    std::unique_ptr<torch::optim::OptimizerOptions> defaults, MixedPrecisionConfig config)
    : torch::optim::Optimizer(std::move(param_groups), std::move(defaults)), config_(config) {
  TORCH_CHECK(!(config.stochastic_rounding && config.master_weights),
              "ampx::optim: stochastic_rounding(true) rounds bf16 params that have no fp32 "
              "master; it needs master_weights(false)");
  if (config.max_grad_norm) {
    TORCH_CHECK(*config.max_grad_norm > 0.0, "ampx::optim: max_grad_norm must be > 0, got ",
                *config.max_grad_norm);
  }
  TORCH_CHECK(!(config.kahan_summation && config.master_weights),
              "ampx::optim: kahan_summation(true) keeps the lost low bits of bf16/fp16 params "
              "that have no fp32 master; it needs master_weights(false)");
  TORCH_CHECK(!(config.kahan_summation && config.stochastic_rounding),
              "ampx::optim: kahan_summation(true) and stochastic_rounding(true) are two ways to "
              "keep small updates of bf16 params; choose one");
  const auto format = static_cast<int32_t>(config.state_format);
  TORCH_CHECK(format >= 0 && format <= static_cast<int32_t>(StateFormat::kInt8),
              "ampx::optim: state_format ", format, " is not a StateFormat");
  const int64_t block = config.state_block;
  TORCH_CHECK(block >= 32 && block <= detail::kMaxStateBlock && (block & (block - 1)) == 0,
              "ampx::optim: state_block must be a power of 2 in [32, ", detail::kMaxStateBlock,
              "], got ", block);
  TORCH_CHECK(config.state_min_numel >= 0, "ampx::optim: state_min_numel must be >= 0, got ",
              config.state_min_numel);
  sync_state_shape();
}

void MixedPrecisionOptimizer::set_piece_sums(PieceSums sums) {
  if (sums) {
    TORCH_CHECK(!config_.max_grad_norm, "ampx::optim::", name(),
                ": set_piece_sums with max_grad_norm=", *config_.max_grad_norm,
                ": the clip norm is over all parameters and each rank has only pieces; clip with "
                "FullyShardedDataParallel::clip_grad_norm_ instead");
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      const auto& params = param_groups_[g].params();
      for (size_t i = 0; i < params.size(); ++i) {
        TORCH_CHECK(params[i].is_cpu(), "ampx::optim::", name(),
                    ": set_piece_sums is implemented for CPU params; param (group ", g, ", index ",
                    i, ") is on ", params[i].device());
      }
    }
  }
  piece_sums_ = std::move(sums);
}

void MixedPrecisionOptimizer::sync_state_shape() {
  states_.resize(param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    states_[g].resize(param_groups_[g].params().size());
  }
}

torch::Tensor MixedPrecisionOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  run_step(at::Tensor(), at::Tensor());
  return loss;
}

void MixedPrecisionOptimizer::step_scaled(const at::Tensor& grad_scale,
                                          const at::Tensor& found_inf) {
  run_step(grad_scale, found_inf);
}

void MixedPrecisionOptimizer::capture_master_weights() {
  c10::NoGradGuard no_grad;
  sync_state_shape();
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].scalar_type() == at::kFloat) {
        states_[g][i].captured = params[i].detach().clone(at::MemoryFormat::Contiguous);
      }
    }
  }
}

void MixedPrecisionOptimizer::prepare(ParamWork& w) const {
  auto& st = *w.state;
  const auto dtype = w.param.scalar_type();
  if (dtype == at::kFloat) {
    st.master = at::Tensor();  // its own master
  } else if (config_.master_weights && !st.master.defined()) {
    const bool use_captured = st.captured.defined() && st.captured.sizes() == w.param.sizes() &&
                              st.captured.device() == w.param.device();
    st.master = use_captured ? st.captured
                             : w.param.detach().to(at::kFloat).clone(at::MemoryFormat::Contiguous);
  }
  st.captured = at::Tensor();
  if (kahan(w.param) && !st.compensation.defined()) {
    st.compensation = at::zeros(w.param.sizes(), w.param.options());
  }
  if (uses_exp_avg(param_groups_[w.group].options()) && !st.exp_avg.defined()) {
    make_moment(w.param, /*is_signed=*/true, st.exp_avg, st.exp_avg_scale);
    st.exp_avg_fresh = true;
  }
  if (uses_exp_avg_sq() && !st.exp_avg_sq.defined()) {
    make_moment(w.param, /*is_signed=*/false, st.exp_avg_sq, st.exp_avg_sq_scale);
  }
}

namespace {

// A param the step takes: float32, bfloat16 or float16, with a dense grad of
// its dtype (bfloat16 under stochastic rounding).
void check_param(const char* name, const at::Tensor& p, size_t g, size_t i,
                 bool stochastic_rounding) {
  const auto dtype = p.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "ampx::optim::", name, ": param (group ", g, ", index ", i, ") has dtype ", dtype,
              "; supported: Float, BFloat16, Half");
  TORCH_CHECK(!p.grad().is_sparse(), "ampx::optim::", name,
              " does not support sparse gradients (param group ", g, ", index ", i, ")");
  TORCH_CHECK(p.grad().scalar_type() == dtype, "ampx::optim::", name, ": param (group ", g,
              ", index ", i, ") is ", dtype, " but its grad is ", p.grad().scalar_type());
  TORCH_CHECK(!(stochastic_rounding && dtype == at::kHalf), "ampx::optim::", name,
              ": stochastic_rounding is for bfloat16 params; param (group ", g, ", index ", i,
              ") is Half");
}

// The params of `groups` that have a gradient, checked (check_param), each
// with its position among all params and its state.
std::vector<ParamWork> params_with_grads(std::vector<torch::optim::OptimizerParamGroup>& groups,
                                         std::vector<std::vector<ParamState>>& states,
                                         const char* name, bool stochastic_rounding) {
  std::vector<ParamWork> work;
  int64_t position = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i, ++position) {
      const auto& p = params[i];
      if (!p.grad().defined()) continue;
      check_param(name, p, g, i, stochastic_rounding);
      work.push_back({g, i, position, p, p.grad(), &states[g][i]});
    }
  }
  return work;
}

// What the grads are multiplied by: 1/scale (rounded as GradScaler rounds
// it) times clip_grad_norm_'s coefficient max / (norm + 1e-6), at most 1;
// undefined for neither.
at::Tensor gradient_multiplier(const std::vector<ParamWork>& work, const at::Tensor& grad_scale,
                               const c10::optional<double>& max_grad_norm) {
  at::Tensor grad_mul;
  if (grad_scale.defined()) {
    grad_mul = ampx::detail::inverse_scale(grad_scale);
  }
  if (max_grad_norm) {
    std::vector<at::Tensor> norms;
    const auto dev = grad_scale.defined() ? grad_scale.device() : work[0].grad.device();
    for (const auto& w : work) {
      norms.push_back(at::linalg_vector_norm(w.grad, 2, c10::nullopt, false, at::kFloat).to(dev));
    }
    auto total = at::stack(norms).norm();
    if (grad_mul.defined()) {
      total = total * grad_mul.to(dev);
    }
    auto coef = (*max_grad_norm / (total + 1e-6)).clamp_max(1.0);
    grad_mul = grad_mul.defined() ? grad_mul.to(dev) * coef : coef;
  }
  return grad_mul;
}

}  // namespace

void MixedPrecisionOptimizer::run_step(const at::Tensor& grad_scale, const at::Tensor& found_inf) {
  c10::NoGradGuard no_grad;
  sync_state_shape();

  std::vector<ParamWork> work =
      params_with_grads(param_groups_, states_, name(), config_.stochastic_rounding);
  const bool whole_norms = piece_sums_ && reads_param_norms();
  if (work.empty()) {
    // The other ranks' step sums pieces across ranks: this one takes part
    // (unless the step is skipped, on every rank).
    if (whole_norms && !(found_inf.defined() && found_inf.item<float>() != 0.f)) {
      (void)piece_sums_({}, at::zeros({0, 2}, at::kDouble));
    }
    return;
  }

  // Skip decision. A CPU flag is read (cheap); a device flag stays a device
  // tensor unless CPU params need the answer on the host.
  bool any_cpu = false;
  for (const auto& w : work) any_cpu |= w.param.is_cpu();
  // (The ATen path's skip mask, made when a param first takes that path:
  // the fused CUDA step reads found_inf itself.)
  at::Tensor skip;
  const bool device_skip = found_inf.defined() && !found_inf.is_cpu() && !any_cpu;
  if (found_inf.defined() && !device_skip && found_inf.item<float>() != 0.f) {
    return;
  }

  const at::Tensor grad_mul = gradient_multiplier(work, grad_scale, config_.max_grad_norm);
  const float grad_mul_host = (any_cpu && grad_mul.defined()) ? grad_mul.item<float>() : 1.f;

  std::vector<ParamWork> fused, fused_cuda;
  for (auto& w : work) {
    const bool cpu_fusable = w.param.is_cpu() && w.param.is_contiguous() && w.grad.is_contiguous();
    if (!cpu_fusable) check_untiled(w, /*cuda_tiles=*/cuda_fusable(w));
    prepare(w);
    TORCH_CHECK(cpu_fusable || !whole_norms, "ampx::optim::", name(),
                ": set_piece_sums needs dense CPU params and grads; param (group ", w.group,
                ", index ", w.index, ") is not");
    if (cpu_fusable) {
      w.state->step += 1;
      w.state->step_t = at::Tensor();
      fused.push_back(w);
      continue;
    }
    auto& st = *w.state;
    if (!st.step_t.defined()) {
      st.step_t = at::full({}, static_cast<double>(st.step), w.param.options().dtype(at::kDouble));
    }
    if (cuda_fusable(w)) {
      fused_cuda.push_back(w);  // the kernels count the step (unless skipped)
      continue;
    }
    if (device_skip && !skip.defined()) skip = found_inf.ne(0);
    const auto dev_skip = skip.defined() ? skip.to(w.param.device(), true) : skip;
    if (dev_skip.defined()) {
      st.step_t.add_(dev_skip.logical_not().to(at::kDouble));
    } else {
      st.step_t.add_(1);
    }
    if (w.param.is_cpu()) {
      st.step += 1;  // host count stays exact on the CPU
    }
    auto g32 = w.grad.to(at::kFloat);
    if (grad_mul.defined()) {
      g32 = g32 * grad_mul.to(w.param.device(), true);
    }
    update_generic(w, g32, dev_skip);
    if (w.param.is_cpu()) {
      st.step_t = at::Tensor();
    }
  }
  if (!fused.empty()) update_cpu(fused, grad_mul_host);
  if (!fused_cuda.empty()) update_cuda(fused_cuda, grad_mul, found_inf);
  // (A first use that found_inf skipped on the device leaves a zero buffer
  // that is no longer fresh, as PyTorch's fused SGD leaves its buffer.)
  for (auto& w : work) w.state->exp_avg_fresh = false;
}

bool MixedPrecisionOptimizer::cuda_fusable(const ParamWork& w) {
  if (!detail::cuda::built() || !w.param.is_cuda() || w.param.is_sparse() ||
      w.grad.device() != w.param.device() || !w.param.is_contiguous() || !w.grad.is_contiguous()) {
    return false;
  }
  const auto& st = *w.state;
  for (const auto* t : {&st.master, &st.exp_avg, &st.exp_avg_sq, &st.exp_avg_scale,
                        &st.exp_avg_sq_scale, &st.compensation}) {
    if (t->defined() && (t->device() != w.param.device() || !t->is_contiguous())) return false;
  }
  return !st.step_t.defined() || st.step_t.device() == w.param.device();
}

namespace {

// The fused kernels write through data pointers: count the write in each
// param's version, as an in-place ATen op would, so that autograd's check of
// saved tensors and caches keyed on the version see the new weights.
void bump_versions(const std::vector<ParamWork>& work) {
  for (const auto& w : work) w.param.unsafeGetTensorImpl()->bump_version();
}

}  // namespace

void MixedPrecisionOptimizer::update_cpu(const std::vector<ParamWork>& work, float grad_mul) {
  std::vector<detail::FusedParam> params;
  std::vector<int64_t> steps;
  for (const auto& w : work) {
    params.push_back(detail::fused_param(w, fused_options(w.group), config_));
    steps.push_back(w.state->step);
  }
  detail::WholeSums whole;
  if (piece_sums_ && reads_param_norms()) {
    whole = [&](std::vector<double>& w_sq, std::vector<double>& u_sq) {
      const int64_t n = static_cast<int64_t>(work.size());
      auto sums = at::empty({n, 2}, at::kDouble);
      auto* in = sums.data_ptr<double>();
      for (int64_t i = 0; i < n; ++i) {
        in[2 * i] = w_sq[static_cast<size_t>(i)];
        in[2 * i + 1] = u_sq[static_cast<size_t>(i)];
      }
      std::vector<at::Tensor> pieces;
      for (const auto& w : work) pieces.push_back(w.param);
      const auto total = piece_sums_(pieces, sums).to(at::kDouble).contiguous();
      TORCH_CHECK(total.dim() == 2 && total.size(0) == n && total.size(1) == 2,
                  "ampx::optim::", name(), ": the piece sums returned ", total.sizes(),
                  ", expected [", n, ", 2]");
      const auto* out = total.data_ptr<double>();
      for (int64_t i = 0; i < n; ++i) {
        w_sq[static_cast<size_t>(i)] = out[2 * i];
        u_sq[static_cast<size_t>(i)] = out[2 * i + 1];
      }
    };
  }
  detail::cpu_step(params, steps, grad_mul, config_.seed, whole ? &whole : nullptr);
  bump_versions(work);
}

void MixedPrecisionOptimizer::update_cuda(const std::vector<ParamWork>& work,
                                          const at::Tensor& grad_mul, const at::Tensor& found_inf) {
  if (!cuda_cache_) cuda_cache_ = std::make_shared<detail::cuda::MetaCache>();
  // One fused step per device, over that device's params.
  std::vector<c10::Device> devices;
  for (const auto& w : work) {
    if (std::find(devices.begin(), devices.end(), w.param.device()) == devices.end()) {
      devices.push_back(w.param.device());
    }
  }
  for (const auto& device : devices) {
    std::vector<detail::cuda::DeviceParam> params;
    for (const auto& w : work) {
      if (w.param.device() != device) continue;
      detail::cuda::DeviceParam d;
      d.p = detail::fused_param(w, fused_options(w.group), config_);
      d.step = w.state->step_t.data_ptr<double>();
      params.push_back(d);
    }
    const auto gm =
        grad_mul.defined() ? grad_mul.to(device, at::kFloat, /*non_blocking=*/true) : at::Tensor();
    const auto fi = found_inf.defined() ? found_inf.to(device, at::kFloat, /*non_blocking=*/true)
                                        : at::Tensor();
    detail::cuda::fused_step(params, device, gm.defined() ? gm.contiguous() : gm,
                             fi.defined() ? fi.contiguous() : fi, config_.seed, *cuda_cache_);
  }
  bump_versions(work);
}

void MixedPrecisionOptimizer::commit(at::Tensor& dst, const at::Tensor& value,
                                     const at::Tensor& skip) {
  if (skip.defined()) {
    dst.copy_(at::where(skip, dst, value.to(dst.scalar_type())));
  } else {
    dst.copy_(value);
  }
}

at::Tensor MixedPrecisionOptimizer::weight_f32(const ParamWork& w) {
  if (w.state->master.defined()) {
    return w.state->master;
  }
  return w.param.scalar_type() == at::kFloat ? w.param : w.param.to(at::kFloat);
}

void MixedPrecisionOptimizer::write_weight(ParamWork& w, const at::Tensor& new_weight,
                                           const at::Tensor& skip) const {
  auto& st = *w.state;
  if (st.master.defined()) {
    commit(st.master, new_weight, skip);
    w.param.copy_(st.master);  // round to nearest even; param == round(master) always
    return;
  }
  TORCH_CHECK(!(config_.stochastic_rounding && w.param.scalar_type() == at::kBFloat16),
              "ampx::optim::", name(),
              ": stochastic_rounding is implemented for dense CPU "
              "params only (param on ",
              w.param.device(), ")");
  commit(w.param, new_weight, skip);
}

const ParamState* MixedPrecisionOptimizer::find_state(const at::Tensor& param) const {
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].is_same(param)) {
        return (g < states_.size() && i < states_[g].size()) ? &states_[g][i] : nullptr;
      }
    }
  }
  TORCH_CHECK(false, "ampx::optim::", name(), ": the tensor is not one of this optimizer's params");
}

at::Tensor MixedPrecisionOptimizer::master(const at::Tensor& param) const {
  const auto* st = find_state(param);
  return st ? st->master : at::Tensor();
}

int64_t MixedPrecisionOptimizer::step_count(const at::Tensor& param) const {
  const auto* st = find_state(param);
  if (!st) return 0;
  return st->step_t.defined() ? static_cast<int64_t>(st->step_t.item<double>()) : st->step;
}

std::vector<at::Tensor> model_params(const MixedPrecisionOptimizer& optimizer) {
  std::vector<at::Tensor> out;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) out.push_back(p);
  }
  return out;
}

std::vector<at::Tensor> master_weights(const MixedPrecisionOptimizer& optimizer) {
  std::vector<at::Tensor> out;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto m = optimizer.master(p);
      out.push_back(m.defined() ? m : p);
    }
  }
  return out;
}

}  // namespace optim
}  // namespace ampx
