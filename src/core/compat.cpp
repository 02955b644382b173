#include "ampx/detail/compat.h"

#include "device_check.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKey.h>
#include <c10/util/Exception.h>

#include <string>

namespace ampx {
namespace detail {
namespace compat {

const char* torch_version() noexcept { return TORCH_VERSION; }

namespace {
void check_device(c10::DeviceType device_type) {
  check_autocast_device(device_type, "ampx autocast");
}
}  // namespace

bool autocast_enabled(c10::DeviceType device_type) {
  check_device(device_type);
#if AMPX_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(device_type);
#else
  return device_type == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled()
                                             : at::autocast::is_enabled();
#endif
}

void set_autocast_enabled(c10::DeviceType device_type, bool enabled) {
  check_device(device_type);
#if AMPX_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device_type, enabled);
#else
  if (device_type == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(enabled);
  } else {
    at::autocast::set_enabled(enabled);
  }
#endif
}

c10::ScalarType autocast_dtype(c10::DeviceType device_type) {
  check_device(device_type);
#if AMPX_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(device_type);
#else
  return device_type == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                             : at::autocast::get_autocast_gpu_dtype();
#endif
}

void set_autocast_dtype(c10::DeviceType device_type, c10::ScalarType dtype) {
  check_device(device_type);
#if AMPX_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device_type, dtype);
#else
  if (device_type == c10::DeviceType::CPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
#endif
}

bool cpu_autocast_supports_half() {
  static const bool supported = [] {
    const auto saved = autocast_dtype(c10::DeviceType::CPU);
    bool ok = true;
    try {
      set_autocast_dtype(c10::DeviceType::CPU, c10::ScalarType::Half);
    } catch (const c10::Error&) {
      ok = false;  // 1.13: "Currently, AutocastCPU only support Bfloat16 ..."
    }
    set_autocast_dtype(c10::DeviceType::CPU, saved);
    return ok;
  }();
  return supported;
}

bool has_native_kernel(const char* name, c10::DeviceType device_type) {
  auto op = c10::Dispatcher::singleton().findSchema({name, ""});
  if (!op) {
    return false;
  }
  const auto key = device_type == c10::DeviceType::CUDA ? c10::DispatchKey::CUDA
                                                        : c10::DispatchKey::CPU;
  return op->hasKernelForDispatchKey(key);
}

}  // namespace compat
}  // namespace detail
}  // namespace ampx
