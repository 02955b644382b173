#pragma once

// The one check of "a device autocast runs on", with one error text for the
// guards, the policy registry and the compat wrappers.

#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

namespace ampx {
namespace detail {

/// Throws c10::ValueError unless `device_type` is cpu or cuda, naming the
/// caller: "set_cast_policy: device_type must be cpu or cuda, got meta".
inline void check_autocast_device(c10::DeviceType device_type, const char* who) {
  TORCH_CHECK_VALUE(device_type == c10::DeviceType::CPU || device_type == c10::DeviceType::CUDA,
                    who, ": device_type must be cpu or cuda, got ",
                    c10::DeviceTypeName(device_type, /*lower_case=*/true));
}

}  // namespace detail
}  // namespace ampx
