#include "ampx/version.h"

#include "ampx/detail/compat.h"

namespace ampx {

const char* version() noexcept {
  return AMPX_VERSION;
}

const char* torch_version() noexcept {
  return detail::compat::torch_version();
}

}  // namespace ampx
