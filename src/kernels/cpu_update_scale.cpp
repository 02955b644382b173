// The loss-scale update on the CPU: four scalars, no tensor ops, so a CPU
// training step pays a few nanoseconds for it instead of a dozen dispatches.

#include "ampx/detail/kernels.h"

#include <algorithm>
#include <cmath>

namespace ampx {
namespace detail {
namespace cpu {

void update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& hysteresis_tracker,
                   const at::Tensor& found_inf, const ScaleUpdateRule& rule) {
  check_update_scale_args(scale, growth_tracker, hysteresis_tracker, found_inf, rule);
  TORCH_CHECK(scale.device().is_cpu(), "ampx::detail::cpu::update_scale_: scale must be a CPU ",
              "tensor, got ", scale.device());
  float& s = *scale.data_ptr<float>();
  int32_t& growth = *growth_tracker.data_ptr<int32_t>();
  int32_t& hyst = *hysteresis_tracker.data_ptr<int32_t>();

  if (*found_inf.data_ptr<float>() != 0.f) {
    growth = 0;
    hyst = std::max<int32_t>(hyst - 1, 0);
    if (hyst == 0) {
      s = static_cast<float>(s * rule.backoff_factor);
    }
  } else {
    const int32_t successful = growth + 1;
    if (successful == rule.growth_interval) {
      const auto grown = static_cast<float>(s * rule.growth_factor);
      if (std::isfinite(grown)) {  // never grow to inf (PyTorch >= 2.1)
        s = grown;
      }
      growth = 0;
      hyst = static_cast<int32_t>(rule.hysteresis);
    } else {
      growth = successful;
    }
  }
  if (rule.min_scale) {
    s = std::max(s, static_cast<float>(*rule.min_scale));
  }
  if (rule.max_scale) {
    s = std::min(s, static_cast<float>(*rule.max_scale));
  }
}

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
