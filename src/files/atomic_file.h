#pragma once

// Whole files: crash-safe writes (save_state_dict, save_archive,
// save_safetensors, ampx-train's checkpoints and outputs) and the one reader
// of a whole file. ampx-train reaches this internal header through the
// ampx_internal target. Not installed: not part of ampx's API.
//
//   ampx::detail::write_file_atomically(path, bytes.data(), bytes.size(), "save_state_dict");
//   ampx::detail::AtomicFile file(path, "save_full_safetensors");  // written in parts
//   file.write_at(offset, data, size);  // any order
//   file.commit();                      // else the destructor removes the temp file
//   auto bytes = ampx::detail::read_file(path);  // nullopt, errno set, when it cannot be opened

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace ampx {
namespace detail {

/// A file written in parts, at any offsets, that appears at `path` whole or
/// not at all: the parts go to a temp file in the same folder; commit()
/// fsyncs it, renames it over `path` and fsyncs the folder. A failed write
/// or commit, or destruction before commit(), removes the temp file and
/// leaves `path` as it was. Errors start with `caller` and name the path.
class AtomicFile {
 public:
  AtomicFile(std::string path, const char* caller);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  /// Writes `size` bytes at byte `offset` of the file.
  void write_at(uint64_t offset, const void* data, size_t size);
  /// Makes the file what `path` names (once; nothing can be written after).
  void commit();

 private:
  /// Removes the temp file and throws "<caller>: cannot write '<path>': <what>".
  [[noreturn]] void fail(const std::string& what);

  std::string path_, tmp_;
  const char* caller_;
  int fd_ = -1;
};

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
