#pragma once

// Checks a LibTorch archive (torch.save's zip, or a bare pickle) before
// LibTorch reads it, for files from outside: LibTorch's readers trust the
// length fields they find and allocate what they say (a 4-byte pickle string
// length, a memo index, a zip record's size), so a hostile or damaged file
// could make them reserve gigabytes. Fuzzing found it (tests/fuzz). Not
// installed: not part of ampx's API. One parser a file under src/files/archive/,
// each with its header: zip_records (the zip's records, record.h's
// ArchiveRecord), pickle_lengths (check_pickle), module_source
// (check_attribute_module_source) and pickle_machine
// (check_output_archive_pickle); archive_check.cpp and
// output_archive_check.cpp compose them.
//
//   ampx::detail::check_torch_archive(bytes.data(), bytes.size(), "load_state_dict: 'x.pt'");
//   torch::pickle_load(bytes);  // every length now bounded by the file's size

#include "archive/record.h"

#include <torch/serialize/input-archive.h>

#include <cstddef>
#include <string>
#include <vector>

namespace ampx {
namespace detail {

/// Throws c10::Error starting with `what` unless every zip record (stored,
/// within the file) and every pickle in it (the whole input when it is not
/// a zip) has length fields and memo indices bounded by the bytes there are.
/// Returns the zip's records so checked (none for a bare pickle).
std::vector<ArchiveRecord> check_torch_archive(const char* data, size_t size,
                                               const std::string& what);

/// The whole check of a file torch::serialize::OutputArchive wrote, before
/// LibTorch reads it: check_torch_archive, then every TorchScript source
/// (inflated where deflated) through check_attribute_module_source, every
/// debug pickle through check_pickle, the constants table empty, and data.pkl
/// through check_output_archive_pickle. Throws c10::Error starting with `what`.
void check_output_archive(const std::string& bytes, const std::string& what);

/// check_output_archive, then `archive` loaded from `bytes` in place; an
/// error of LibTorch's reader becomes "<what> holds no readable LibTorch
/// archive: ...". ampx::load_archive and ampx-train's checkpoints read so.
void load_output_archive(const std::string& bytes, torch::serialize::InputArchive& archive,
                         const std::string& what);

}  // namespace detail
}  // namespace ampx
