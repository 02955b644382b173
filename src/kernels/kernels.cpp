// ampx/kernels/loss_scale.h: routing of the AMP kernels to ATen's or ampx's
// implementation, the shared argument checks, and the device-generic
// composite versions.

#include "ampx/kernels/loss_scale.h"

#include "ampx/detail/compat.h"
#include "ampx/detail/kernels.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace ampx {
namespace detail {

void check_unscale_args(at::TensorList grads, const at::Tensor& found_inf,
                        const at::Tensor& inv_scale) {
  TORCH_CHECK(found_inf.numel() == 1, "non_finite_check_and_unscale_: found_inf must be a ",
              "1-element tensor, got ", found_inf.numel(), " elements");
  TORCH_CHECK(inv_scale.numel() == 1, "non_finite_check_and_unscale_: inv_scale must be a ",
              "1-element tensor, got ", inv_scale.numel(), " elements");
  TORCH_CHECK(found_inf.scalar_type() == at::kFloat, "non_finite_check_and_unscale_: found_inf ",
              "must be a float tensor, got ", found_inf.scalar_type());
  TORCH_CHECK(inv_scale.scalar_type() == at::kFloat, "non_finite_check_and_unscale_: inv_scale ",
              "must be a float tensor, got ", inv_scale.scalar_type());
  TORCH_CHECK(found_inf.device() == inv_scale.device(), "non_finite_check_and_unscale_: ",
              "found_inf (", found_inf.device(), ") and inv_scale (", inv_scale.device(),
              ") must be on the same device");
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
    TORCH_CHECK(g.device() == found_inf.device(), "non_finite_check_and_unscale_: grads[", i,
                "] is on ", g.device(), " but found_inf is on ", found_inf.device());
    TORCH_CHECK(g.layout() == at::kStrided, "non_finite_check_and_unscale_: grads[", i,
                "] must be strided, got ", g.layout(), " (unscale a sparse grad's _values())");
    const auto t = g.scalar_type();
    TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16,
                "non_finite_check_and_unscale_: grads[", i, "] must be float32, float64, ",
                "float16 or bfloat16, got ", t);
  }
}

void check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                             const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                             const ScaleUpdateRule& rule) {
  TORCH_CHECK(scale.numel() == 1 && scale.scalar_type() == at::kFloat,
              "update_scale_: scale must be a 1-element float tensor, got ", scale.numel(),
              " elements of ", scale.scalar_type());
  TORCH_CHECK(growth_tracker.numel() == 1 && growth_tracker.scalar_type() == at::kInt,
              "update_scale_: growth_tracker must be a 1-element int32 tensor, got ",
              growth_tracker.numel(), " elements of ", growth_tracker.scalar_type());
  TORCH_CHECK(hysteresis_tracker.numel() == 1 && hysteresis_tracker.scalar_type() == at::kInt,
              "update_scale_: hysteresis_tracker must be a 1-element int32 tensor, got ",
              hysteresis_tracker.numel(), " elements of ", hysteresis_tracker.scalar_type());
  TORCH_CHECK(found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat,
              "update_scale_: found_inf must be a 1-element float tensor, got ", found_inf.numel(),
              " elements of ", found_inf.scalar_type());
  for (const auto* t : {&growth_tracker, &hysteresis_tracker, &found_inf}) {
    TORCH_CHECK(t->device() == scale.device(), "update_scale_: all tensors must be on the ",
                "scale's device ", scale.device(), ", got one on ", t->device());
  }
  TORCH_CHECK(rule.growth_interval > 0, "update_scale_: growth_interval must be > 0, got ",
              rule.growth_interval);
  TORCH_CHECK(rule.hysteresis >= 1, "update_scale_: hysteresis must be >= 1, got ",
              rule.hysteresis);
}

void non_finite_check_and_unscale_composite_(at::TensorList grads, at::Tensor& found_inf,
                                             const at::Tensor& inv_scale) {
  check_unscale_args(grads, found_inf, inv_scale);
  for (const auto& g : grads) {
    if (g.numel() == 0) {
      continue;
    }
    // Two passes (a reduction, then the multiply) but no host sync.
    auto bad = at::isfinite(g).logical_not().any().to(at::kFloat).reshape(found_inf.sizes());
    at::maximum_out(found_inf, found_inf, bad);
    g.mul_(inv_scale.to(g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  }
}

void update_scale_composite_(at::Tensor& scale, at::Tensor& growth_tracker,
                             at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                             const ScaleUpdateRule& rule) {
  check_update_scale_args(scale, growth_tracker, hysteresis_tracker, found_inf, rule);
  const auto found = found_inf.ne(0);
  const auto hyst_dec = (hysteresis_tracker - 1).clamp_min(0);
  const auto do_backoff = found.logical_and(hyst_dec.eq(0));
  const auto successful = growth_tracker + 1;
  const auto grow = found.logical_not().logical_and(successful.eq(rule.growth_interval));
  const auto scale64 = scale.to(at::kDouble);
  const auto backed = (scale64 * rule.backoff_factor).to(at::kFloat);
  const auto grown = (scale64 * rule.growth_factor).to(at::kFloat);
  auto next = at::where(do_backoff, backed,
                        at::where(grow.logical_and(at::isfinite(grown)), grown, scale));
  if (rule.min_scale || rule.max_scale) {
    next = next.clamp(rule.min_scale ? c10::optional<at::Scalar>(*rule.min_scale) : c10::nullopt,
                      rule.max_scale ? c10::optional<at::Scalar>(*rule.max_scale) : c10::nullopt);
  }
  const auto zero = at::zeros_like(growth_tracker);
  const auto next_growth = at::where(found.logical_or(grow), zero, successful);
  const auto refill = at::full_like(hysteresis_tracker, rule.hysteresis);
  const auto next_hyst =
      at::where(found, hyst_dec, at::where(grow, refill, hysteresis_tracker));
  scale.copy_(next);
  growth_tracker.copy_(next_growth);
  hysteresis_tracker.copy_(next_hyst);
}

}  // namespace detail

void non_finite_check_and_unscale_(at::TensorList grads, at::Tensor& found_inf,
                                   const at::Tensor& inv_scale) {
  if (grads.empty()) {
    return;
  }
  const auto device = found_inf.device().type();
  if (device == c10::DeviceType::CPU &&
      !detail::compat::has_native_kernel("aten::_amp_foreach_non_finite_check_and_unscale_",
                                         device)) {
    detail::cpu::non_finite_check_and_unscale_(grads, found_inf, inv_scale);
    return;
  }
  detail::check_unscale_args(grads, found_inf, inv_scale);
  // CUDA's kernel has no bfloat16 (pytorch#127176): those go the composite way.
  std::vector<at::Tensor> native, composite;
  for (const auto& g : grads) {
    (device == c10::DeviceType::CUDA && g.scalar_type() == at::kBFloat16 ? composite : native)
        .push_back(g);
  }
  if (!native.empty()) {
    at::_amp_foreach_non_finite_check_and_unscale_(native, found_inf, inv_scale);
  }
  if (!composite.empty()) {
    detail::non_finite_check_and_unscale_composite_(composite, found_inf, inv_scale);
  }
}

void update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& hysteresis_tracker,
                   const at::Tensor& found_inf, const ScaleUpdateRule& rule) {
  const auto device = scale.device().type();
  if (device == c10::DeviceType::CPU) {
    detail::cpu::update_scale_(scale, growth_tracker, hysteresis_tracker, found_inf, rule);
    return;
  }
  if (rule.hysteresis == 1 &&
      detail::compat::has_native_kernel("aten::_amp_update_scale_", device)) {
    detail::check_update_scale_args(scale, growth_tracker, hysteresis_tracker, found_inf, rule);
    at::_amp_update_scale_(scale, growth_tracker, found_inf, rule.growth_factor,
                           rule.backoff_factor, rule.growth_interval);
    if (rule.min_scale || rule.max_scale) {
      scale.clamp_(rule.min_scale ? c10::optional<at::Scalar>(*rule.min_scale) : c10::nullopt,
                   rule.max_scale ? c10::optional<at::Scalar>(*rule.max_scale) : c10::nullopt);
    }
    return;
  }
  detail::update_scale_composite_(scale, growth_tracker, hysteresis_tracker, found_inf, rule);
}

}  // namespace ampx
