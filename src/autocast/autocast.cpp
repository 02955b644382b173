#include "ampx/autocast.h"

#include "ampx/policy.h"

#include "ampx/detail/compat.h"
#include "autocast_region.h"
#include "../core/device_check.h"
#include "../policy/registry.h"

#include <ATen/autocast_mode.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>

namespace ampx {

bool is_autocast_enabled(c10::DeviceType device_type) {
  return detail::compat::autocast_enabled(device_type);
}

c10::ScalarType get_autocast_dtype(c10::DeviceType device_type) {
  return detail::compat::autocast_dtype(device_type);
}

bool is_autocast_cache_enabled() { return at::autocast::is_autocast_cache_enabled(); }

void clear_autocast_cache() { at::autocast::clear_cache(); }

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

AutocastGuard::AutocastGuard(c10::DeviceType device_type, c10::optional<c10::ScalarType> dtype,
                             bool enabled, bool cache_enabled)
    : region_(
          std::make_unique<detail::AutocastRegion>(device_type, dtype, enabled, cache_enabled)) {
  // (A WideProductsGuard that throws leaves region_ to exit the region.)
  if (region_->enabled() &&
      detail::autocast_guard_wants_wide_products(device_type, region_->dtype())) {
    wide_ = std::make_unique<WideProductsGuard>();
  }
}

AutocastGuard::~AutocastGuard() {
  wide_.reset();
  region_.reset();
}

c10::DeviceType AutocastGuard::device_type() const noexcept { return region_->device_type(); }

c10::ScalarType AutocastGuard::dtype() const noexcept { return region_->dtype(); }

bool AutocastGuard::enabled() const noexcept { return region_->enabled(); }

namespace detail {
at::Tensor cast_for_custom_fwd(const at::Tensor& t, c10::DeviceType device_type,
                               c10::ScalarType dtype) {
  if (t.defined() && t.is_floating_point() && t.device().type() == device_type &&
      t.scalar_type() != c10::kDouble) {
    return t.to(dtype);
  }
  return t;
}
}  // namespace detail

}  // namespace ampx
