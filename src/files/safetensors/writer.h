#pragma once

// A safetensors file written one entry at a time, for a writer that never
// holds every tensor at once (FullyShardedDataParallel::save_full_safetensors
// gathers a unit at a time). The header and the layout are
// save_safetensors()'s (data in name order, 8-aligned), so the same
// tensors give the same bytes. Not installed: not part of ampx's API.
//
//   ampx::detail::SafetensorsFileWriter file(path, {{"fc.weight", at::kFloat, {4, 8}}, ...},
//                                            metadata, "save_full_safetensors");
//   file.write("fc.weight", w);  // each entry once, in any order
//   file.write_part("fc.bias", 0, b.narrow(0, 0, 2));  // or in parts
//   file.commit();               // every entry written: the file appears at path

#include "../atomic_file.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace ampx {
namespace detail {

/// An entry of the file: its name, dtype and shape.
struct SafetensorsEntry {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
};

class SafetensorsFileWriter {
 public:
  /// Starts the file at `path` (through a temp file beside it, as
  /// AtomicFile does) with the header of `entries` and `metadata`. Errors
  /// start with `caller`: a name given twice or "__metadata__", a dtype
  /// the format has no name for, the file that cannot be created.
  SafetensorsFileWriter(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                        const std::map<std::string, std::string>& metadata, const char* caller);

  /// Writes entry `name`'s bytes: `value` (any device) must have its dtype
  /// and shape, and each entry is written once.
  void write(const std::string& name, const at::Tensor& value);
  /// Writes elements [first, first + values.numel()) of entry `name`, in
  /// its row-major order, from `values` (its dtype, any shape): an entry
  /// can come in parts, each of its elements once.
  void write_part(const std::string& name, int64_t first, const at::Tensor& values);
  /// Every entry written: renames the file over `path`. Without it the
  /// temp file is removed and `path` is as it was.
  void commit();

 private:
  struct Place {
    uint64_t offset = 0, bytes = 0;  // in the data, after the header
    c10::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t numel = 0;
    std::map<int64_t, int64_t> written;  // element ranges written: first -> end
    int64_t written_elements = 0;
  };
  const char* caller_;
  AtomicFile file_;
  std::map<std::string, Place> places_;
  uint64_t data_start_ = 0;
};

}  // namespace detail
}  // namespace ampx
