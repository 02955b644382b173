#pragma once

// Whole files: crash-safe writes (save_state_dict, save_archive,
// save_safetensors, ampx-train's checkpoints and outputs) and the one reader
// of a whole file. ampx-train reaches this internal header through the
// ampx_internal target. Not installed: not part of ampx's API.
//
//   ampx::detail::write_file_atomically(path, bytes.data(), bytes.size(), "save_state_dict");
//   auto bytes = ampx::detail::read_file(path);  // nullopt, errno set, when it cannot be opened

#include <cstddef>
#include <optional>
#include <string>

namespace ampx {
namespace detail {

/// Writes `size` bytes to `path` so that a crash at any point leaves either
/// the old file or the new one, never a mix: a temp file in the same folder,
/// fsync, rename over `path`, fsync of the folder. Errors start with `caller`
/// and name the path; the temp file is removed on failure.
void write_file_atomically(const std::string& path, const void* data, size_t size,
                           const char* caller = "write_file_atomically");

/// The bytes of the file at `path`, or nullopt with errno saying why it
/// could not be opened (each caller words its own error).
std::optional<std::string> read_file(const std::string& path);

}  // namespace detail
}  // namespace ampx
