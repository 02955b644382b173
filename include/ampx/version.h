#pragma once

// ampx's version (the library's, not LibTorch's).

#define AMPX_VERSION_MAJOR 0
#define AMPX_VERSION_MINOR 1
#define AMPX_VERSION_PATCH 0

namespace ampx {
/// "major.minor.patch" of ampx, and of the LibTorch it was built against.
const char* version() noexcept;
const char* torch_version() noexcept;
}  // namespace ampx
