#pragma once

// The zip container of a LibTorch archive (torch.save's format, and
// torch::serialize::OutputArchive's): its records, found through the
// central directory, with their sizes and places checked against the file.
// check_torch_archive (archive_check.cpp) reads archives through it.

#include "record.h"

#include <cstddef>
#include <string>
#include <vector>

namespace ampx {
namespace detail {

/// The records of the zip archive [data, data + size), each within the file,
/// stored (pickles) or stored or deflated within deflate's 1032:1 (others).
/// Throws c10::Error starting with `what` otherwise.
std::vector<ArchiveRecord> zip_records(const char* data, size_t size, const std::string& what);

}  // namespace detail
}  // namespace ampx
