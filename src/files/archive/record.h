#pragma once

// ArchiveRecord: one record of a LibTorch zip archive as the checks of
// src/files/archive/ find it (zip_records.h), and as their composers
// (archive_check.h) hand it on.

#include <cstdint>
#include <string>

namespace ampx {
namespace detail {

/// One record of a LibTorch zip archive, as check_torch_archive found it: its
/// data is [offset, offset + size) of the archive, within it.
struct ArchiveRecord {
  std::string name;
  uint64_t offset = 0, size = 0;
  uint64_t inflated_size = 0;  // its size once inflated (== size unless deflated)
  bool deflated = false;
  bool pickle = false;  // a .pkl record (LibTorch stores pickles as they are)
};

}  // namespace detail
}  // namespace ampx
