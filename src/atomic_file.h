#pragma once

// Crash-safe file writes, for save_state_dict and ampx-train's checkpoints
// (the trainer reaches this one internal header through its include path).
// Not installed: not part of ampx's API.
//
//   ampx::detail::write_file_atomically(path, bytes.data(), bytes.size(), "save_state_dict");

#include <cstddef>
#include <string>

namespace ampx {
namespace detail {

/// Writes `size` bytes to `path` so that a crash at any point leaves either
/// the old file or the new one, never a mix: a temp file in the same folder,
/// fsync, rename over `path`, fsync of the folder. Errors start with `caller`
/// and name the path; the temp file is removed on failure.
void write_file_atomically(const std::string& path, const void* data, size_t size,
                           const char* caller = "write_file_atomically");

}  // namespace detail
}  // namespace ampx
