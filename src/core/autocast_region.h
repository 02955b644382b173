#pragma once

// An autocast region and nothing more: torch.autocast's enter and exit steps
// (ampx/autocast.h), below both guards that open one. AutocastGuard is a
// region plus, on the CPU, a WideProductsGuard (ampx/policy.h); a
// WideProductsGuard made outside autocast opens a region of its own, so the
// two guards depend one way: AutocastGuard -> WideProductsGuard ->
// AutocastRegion.
//
//   ampx::detail::AutocastRegion region(c10::kCPU, c10::nullopt, true, true);
//   region.dtype();  // c10::kBFloat16, the thread's CPU autocast dtype

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

namespace ampx {
namespace detail {

/// Enters torch.autocast(device_type, dtype, enabled, cache_enabled) on
/// construction and exits it on destruction, with AutocastGuard's checks and
/// errors (ampx/autocast.h: device, dtype, CUDA missing), and no wide
/// products.
class AutocastRegion {
 public:
  AutocastRegion(c10::DeviceType device_type, c10::optional<c10::ScalarType> dtype, bool enabled,
                 bool cache_enabled);
  ~AutocastRegion();

  AutocastRegion(const AutocastRegion&) = delete;
  AutocastRegion& operator=(const AutocastRegion&) = delete;

  c10::DeviceType device_type() const noexcept { return device_type_; }
  c10::ScalarType dtype() const noexcept { return dtype_; }
  /// False when constructed disabled, or disabled because CUDA is missing.
  bool enabled() const noexcept { return enabled_; }

 private:
  c10::DeviceType device_type_;
  c10::ScalarType dtype_;
  bool enabled_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_cache_enabled_;
};

}  // namespace detail
}  // namespace ampx
