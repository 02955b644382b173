#include "ampx/autocast.h"

#include "ampx/policy.h"

#include "../core/autocast_region.h"
#include "../policy/registry.h"
#include "ampx/detail/compat.h"

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
