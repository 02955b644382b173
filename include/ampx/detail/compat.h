#pragma once

// The one place that knows LibTorch versions. LibTorch 1.13 (Debian 12) and
// 2.x (Debian 13, CUDA wheels) differ in the autocast C++ API and in which AMP
// kernels exist for the CPU; everything else in ampx calls these wrappers.
//
//   if (ampx::detail::compat::native_amp_kernel(c10::DeviceType::CPU, ...))

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/version.h>

#define AMPX_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||       \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// LibTorch 2.1 introduced at::kFloat8_e4m3fn and at::kFloat8_e5m2.
#define AMPX_HAS_TORCH_FLOAT8 AMPX_TORCH_AT_LEAST(2, 1)
// at::_scaled_mm with scales as arguments and one result: LibTorch 2.5+
// (before, scales were keyword arguments and it returned (out, amax)).
#define AMPX_HAS_SCALED_MM AMPX_TORCH_AT_LEAST(2, 5)

namespace ampx {
namespace detail {
namespace compat {

/// LibTorch's version as "major.minor.patch".
const char* torch_version() noexcept;

/// Whether autocast is on for `device_type` in this thread.
bool autocast_enabled(c10::DeviceType device_type);
void set_autocast_enabled(c10::DeviceType device_type, bool enabled);

/// The lower-precision dtype autocast uses for `device_type` in this thread.
c10::ScalarType autocast_dtype(c10::DeviceType device_type);
void set_autocast_dtype(c10::DeviceType device_type, c10::ScalarType dtype);

/// Whether this LibTorch build can run CPU autocast in float16 (2.x: yes,
/// 1.13: no, its AutocastCPU accepts bfloat16 only). Probed once.
bool cpu_autocast_supports_half();

/// Whether the ATen operator `name` (e.g. "aten::_amp_update_scale_") has a
/// kernel for `device_type` in this build. LibTorch 1.13 has the AMP scaler
/// kernels for CUDA only; 2.3+ has them for the CPU too.
bool has_native_kernel(const char* name, c10::DeviceType device_type);

}  // namespace compat
}  // namespace detail
}  // namespace ampx
