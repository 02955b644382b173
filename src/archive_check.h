#pragma once

// Checks a LibTorch archive (torch.save's zip, or a bare pickle) before
// LibTorch reads it, for files from outside: LibTorch's readers trust the
// length fields they find and allocate what they say (a 4-byte pickle string
// length, a memo index, a zip record's size), so a hostile or damaged file
// could make them reserve gigabytes. Fuzzing found it (tests/fuzz). Not
// installed: not part of ampx's API. One parser a file under src/archive/:
// zip_records.cpp, pickle_lengths.cpp (check_pickle), module_source.cpp
// (check_attribute_module_source) and pickle_machine.cpp
// (check_output_archive_pickle); archive_check.cpp and
// output_archive_check.cpp compose them.
//
//   ampx::detail::check_torch_archive(bytes.data(), bytes.size(), "load_state_dict: 'x.pt'");
//   torch::pickle_load(bytes);  // every length now bounded by the file's size

#include <torch/serialize/input-archive.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

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

/// Throws c10::Error starting with `what` unless every zip record (stored,
/// within the file) and every pickle in it (the whole input when it is not
/// a zip) has length fields and memo indices bounded by the bytes there are.
/// Returns the zip's records so checked (none for a bare pickle).
std::vector<ArchiveRecord> check_torch_archive(const char* data, size_t size,
                                               const std::string& what);

/// The same for one pickle stream.
void check_pickle(const char* data, size_t size, const std::string& what);

/// Throws c10::Error starting with `what` unless `source`, the TorchScript
/// source record `name` of an archive written by torch::serialize::
/// OutputArchive, holds only what OutputArchive writes: one attribute-only
/// class,
///
///   class Module(Module):
///     __parameters__ = ["weight", ]
///     __buffers__ = []
///     weight : Tensor
///     sub : __torch__.___torch_mangle_3.Module
///     __annotations__["group0.lr"] = float
///
/// with names in double quotes or identifiers and types among Tensor, int,
/// float, bool, str, Optional/List of those, and the archive's own module
/// classes. LibTorch's TorchScript importer compiles this source before any
/// value is read, and LibTorch 1.13's crashes on some malformed class bodies
/// (a class constant where an attribute list was: tests/fuzz/README.md).
void check_attribute_module_source(const std::string& name, const std::string& source,
                                   const std::string& what);

/// Throws c10::Error starting with `what` unless `pickle`, the data.pkl of an
/// archive written by torch::serialize::OutputArchive, means only what
/// OutputArchive writes, checked by running it on a pickle machine that
/// tracks what each stack entry is: module objects (__torch__ classes) whose
/// state is a dict of string keys; tensors rebuilt by _rebuild_tensor_v2 from
/// a persistent storage ("storage", torch.<T>Storage, key, location, numel)
/// whose record data/<key> (`storage_bytes`: key -> record size) holds numel
/// elements, with sizes and strides that keep the view inside the storage;
/// ints, floats, bools, strings, None, lists and tuples of them. LibTorch's
/// unpickler trusts the types on its stack (a dict where the storage tuple
/// was crashed LibTorch 1.13: tests/fuzz/README.md).
void check_output_archive_pickle(const char* pickle, size_t size,
                                 const std::map<std::string, uint64_t>& storage_bytes,
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
