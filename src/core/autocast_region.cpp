// torch.autocast's enter and exit steps (autocast_region.h), with
// AutocastGuard's checks and errors.

#include "autocast_region.h"

#include "ampx/detail/compat.h"
#include "device_check.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

namespace ampx {

namespace {

c10::ScalarType checked_dtype(c10::DeviceType device_type, c10::optional<c10::ScalarType> dtype) {
  detail::check_autocast_device(device_type, "AutocastGuard");
  const auto resolved = dtype.value_or(detail::compat::autocast_dtype(device_type));
  TORCH_CHECK_VALUE(resolved == c10::kHalf || resolved == c10::kBFloat16,
                    "AutocastGuard: dtype must be float16 or bfloat16 for device_type ",
                    c10::DeviceTypeName(device_type, /*lower_case=*/true), ", got ", resolved);
  if (device_type == c10::DeviceType::CPU && resolved == c10::kHalf) {
    TORCH_CHECK_VALUE(detail::compat::cpu_autocast_supports_half(),
                      "AutocastGuard: float16 autocast on the CPU needs LibTorch 2.x; LibTorch ",
                      detail::compat::torch_version(),
                      " runs CPU autocast in bfloat16 only. Use dtype torch::kBFloat16 "
                      "(the CPU default) or run on CUDA.");
  }
  return resolved;
}

}  // namespace

namespace detail {

AutocastRegion::AutocastRegion(c10::DeviceType device_type, c10::optional<c10::ScalarType> dtype,
                               bool enabled, bool cache_enabled)
    : device_type_(device_type), dtype_(checked_dtype(device_type, dtype)), enabled_(enabled) {
  if (enabled_ && device_type_ == c10::DeviceType::CUDA && !at::globalContext().hasCUDA()) {
    // Once per process: a loop opens a guard every step, and Python's
    // warnings filter shows torch.autocast's warning once per call site.
    TORCH_WARN_ONCE(
        "AutocastGuard: device_type cuda was requested but CUDA is not available. "
        "Disabling autocast.");
    enabled_ = false;
  }
  // The steps and their order are those of torch.autocast.__enter__.
  prev_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
  prev_enabled_ = compat::autocast_enabled(device_type_);
  prev_dtype_ = compat::autocast_dtype(device_type_);
  compat::set_autocast_enabled(device_type_, enabled_);
  compat::set_autocast_dtype(device_type_, dtype_);
  at::autocast::increment_nesting();
  at::autocast::set_autocast_cache_enabled(cache_enabled);
}

AutocastRegion::~AutocastRegion() {
  // torch.autocast.__exit__: the outermost region drops the weight-cast cache.
  if (at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  compat::set_autocast_enabled(device_type_, prev_enabled_);
  compat::set_autocast_dtype(device_type_, prev_dtype_);
  at::autocast::set_autocast_cache_enabled(prev_cache_enabled_);
}

}  // namespace detail

}  // namespace ampx
