// save_safetensors (ampx/safetensors.h): the header written by nlohmann-json,
// then every tensor's CPU bytes, in one atomic write;
// and SafetensorsFileWriter (writer.h): the same file, an entry at a time.

#include "ampx/safetensors.h"

#include "../atomic_file.h"
#include "ampx/detail/compat.h"
#include "ampx/fp8/cast.h"
#include "dtypes.h"
#include "writer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <iterator>
#include <vector>

namespace ampx {
namespace {

const char* fp8_dtype_name(fp8::Fp8Format format) {
  for (const auto& d : detail::kSafetensorsFp8Dtypes) {
    if (d.format == format) return d.name;
  }
  TORCH_CHECK(false, "save_safetensors: unknown FP8 format ", static_cast<int>(format));
}

const char* dtype_name(c10::ScalarType type, const std::string& tensor,
                       const char* caller = "save_safetensors") {
  for (const auto& d : detail::kSafetensorsDtypes) {
    if (d.type == type) return d.name;
  }
#if AMPX_HAS_TORCH_FLOAT8
  for (const auto& d : detail::kSafetensorsFp8Dtypes) {
    if (type == fp8::torch_dtype(d.format)) return d.name;
  }
#endif
  TORCH_CHECK(false, caller, ": tensor '", tensor, "' is ", type,
              "; safetensors files take F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL"
#if AMPX_HAS_TORCH_FLOAT8
              ", Float8_e4m3fn or Float8_e5m2"
#endif
              " (FP8 codes with their scale: SafetensorsContents::fp8)");
}

// An entry to write: its dtype's name in the header and its tensor.
struct OutEntry {
  const char* dtype;
  at::Tensor tensor;
};

// An entry of the header: its dtype's name, its shape and its bytes.
struct HeaderEntry {
  const char* dtype;
  std::vector<int64_t> shape;
  uint64_t bytes;
};

/// Refuses `text` unless it is UTF-8, as the header's JSON must be: a name
/// with other bytes would make a file that no reader (ampx's, Python's)
/// opens. `what` names the string for the error.
void check_utf8(const std::string& caller, const std::string& what, const std::string& text) {
  try {
    (void)nlohmann::json(text).dump();  // strict: throws on a byte that is not UTF-8
  } catch (const nlohmann::json::type_error& e) {
    TORCH_CHECK(false, caller, ": ", what, " is not UTF-8, which a safetensors header (JSON) ",
                "must be: ", e.what());
  }
}

/// check_utf8 of every string the header will hold, before anything is
/// copied or written.
void check_header_strings(const std::string& caller, const std::vector<std::string>& names,
                          const std::map<std::string, std::string>& metadata) {
  for (const auto& [k, v] : metadata) {
    check_utf8(caller, "metadata key '" + k + "'", k);
    check_utf8(caller, "the value of metadata key '" + k + "'", v);
  }
  for (const auto& name : names) check_utf8(caller, "tensor name '" + name + "'", name);
}

// The file up to its data: the header's length (u64, little-endian) and the
// header of `entries`, whose data lie end to end in name order; its strings
// passed check_header_strings. Each piece is dumped on its own and joined:
// an ordered_json object would search its keys at every insert.
std::string file_start(const std::map<std::string, HeaderEntry>& entries,
                       const std::map<std::string, std::string>& metadata) {
  std::string header = "{";
  if (!metadata.empty()) header += "\"__metadata__\":" + nlohmann::json(metadata).dump();
  uint64_t offset = 0;
  for (const auto& [name, entry] : entries) {
    const nlohmann::ordered_json e = {{"dtype", entry.dtype},
                                      {"shape", entry.shape},
                                      {"data_offsets", {offset, offset + entry.bytes}}};
    header += (header.size() > 1 ? "," : "") + nlohmann::json(name).dump() + ":" + e.dump();
    offset += entry.bytes;
  }
  header += "}";  // compact, as the reference writer's
  // The data start 8-aligned, as the reference writer makes them: spaces pad
  // the header (JSON ignores them).
  header.append((8 - (8 + header.size()) % 8) % 8, ' ');
  std::string start(8, '\0');
  const uint64_t header_bytes = header.size();
  std::memcpy(start.data(), &header_bytes, 8);
  return start + header;
}

void write_entries(const std::map<std::string, OutEntry>& entries, const std::string& path,
                   const std::map<std::string, std::string>& metadata) {
  std::vector<std::string> names;
  for (const auto& kv : entries) names.push_back(kv.first);
  check_header_strings("save_safetensors", names, metadata);
  std::map<std::string, HeaderEntry> header;
  std::vector<at::Tensor> bytes_of;
  uint64_t data_bytes = 0;
  for (const auto& [name, entry] : entries) {
    const at::Tensor c = entry.tensor.detach().to(at::kCPU).contiguous();
    const uint64_t n = static_cast<uint64_t>(c.numel()) * c.element_size();
    header.emplace(name, HeaderEntry{entry.dtype, c.sizes().vec(), n});
    data_bytes += n;
    bytes_of.push_back(c);
  }
  std::string file = file_start(header, metadata);
  file.reserve(file.size() + data_bytes);
  for (const auto& c : bytes_of) {
    file.append(static_cast<const char*>(c.data_ptr()),
                static_cast<size_t>(c.numel()) * c.element_size());
  }
  detail::write_file_atomically(path, file.data(), file.size(), "save_safetensors");
}

// Adds `tensor` as entry `name` of `entries`; `what` says what it is, for the
// error when the name is taken.
void add_entry(std::map<std::string, OutEntry>& entries, const std::string& name,
               const at::Tensor& tensor, const char* dtype, const std::string& what) {
  TORCH_CHECK(name != "__metadata__", "save_safetensors: a tensor cannot be named __metadata__");
  TORCH_CHECK(entries.emplace(name, OutEntry{dtype, tensor}).second,
              "save_safetensors: two entries are named '", name, "' (one of them ", what, ")");
}

void add_tensor(std::map<std::string, OutEntry>& entries, const std::string& name,
                const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "save_safetensors: tensor '", name, "' is undefined");
  add_entry(entries, name, t, dtype_name(t.scalar_type(), name), "a tensor");
}

}  // namespace

namespace detail {

SafetensorsFileWriter::SafetensorsFileWriter(const std::string& path,
                                             const std::vector<SafetensorsEntry>& entries,
                                             const std::map<std::string, std::string>& metadata,
                                             const char* caller)
    : caller_(caller), file_(path, caller) {
  std::vector<std::string> names;
  for (const auto& e : entries) names.push_back(e.name);
  check_header_strings(caller_, names, metadata);
  std::map<std::string, HeaderEntry> header;
  for (const auto& e : entries) {
    TORCH_CHECK(e.name != "__metadata__", caller_, ": a tensor cannot be named __metadata__");
    int64_t numel = 1;
    for (const int64_t d : e.shape) numel *= d;
    const uint64_t bytes = static_cast<uint64_t>(numel) * c10::elementSize(e.dtype);
    TORCH_CHECK(
        header.emplace(e.name, HeaderEntry{dtype_name(e.dtype, e.name, caller_), e.shape, bytes})
            .second,
        caller_, ": two entries are named '", e.name, "'");
    places_[e.name] = Place{0, bytes, e.dtype, e.shape, numel, {}, 0};
  }
  uint64_t offset = 0;
  for (auto& [name, place] : places_) {  // name order, as file_start lays them
    place.offset = offset;
    offset += place.bytes;
  }
  const std::string start = file_start(header, metadata);
  data_start_ = start.size();
  file_.write_at(0, start.data(), start.size());
}

void SafetensorsFileWriter::write(const std::string& name, const at::Tensor& value) {
  const auto found = places_.find(name);
  TORCH_CHECK(found != places_.end(), caller_, ": '", name, "' is not an entry of the file");
  const Place& place = found->second;
  TORCH_CHECK(value.scalar_type() == place.dtype && value.sizes().vec() == place.shape, caller_,
              ": entry '", name, "' is ", place.dtype, " ", c10::IntArrayRef(place.shape),
              "; given ", value.scalar_type(), " ", value.sizes());
  write_part(name, 0, value);
}

void SafetensorsFileWriter::write_part(const std::string& name, int64_t first,
                                       const at::Tensor& values) {
  const auto found = places_.find(name);
  TORCH_CHECK(found != places_.end(), caller_, ": '", name, "' is not an entry of the file");
  Place& place = found->second;
  const int64_t n = values.numel(), end = first + n;
  TORCH_CHECK(values.scalar_type() == place.dtype, caller_, ": entry '", name, "' is ", place.dtype,
              "; given ", values.scalar_type());
  TORCH_CHECK(first >= 0 && end <= place.numel, caller_, ": elements [", first, ", ", end,
              ") are not in entry '", name, "' of ", place.numel);
  if (n == 0) return;
  // The ranges written so far neither reach into this one from below nor start inside it.
  const auto next = place.written.lower_bound(first);
  const bool overlaps = (next != place.written.end() && next->first < end) ||
                        (next != place.written.begin() && std::prev(next)->second > first);
  TORCH_CHECK(!overlaps, caller_, ": elements [", first, ", ", end, ") of entry '", name,
              "' are written twice");
  const at::Tensor c = values.detach().to(at::kCPU).contiguous();
  const uint64_t size = c10::elementSize(place.dtype);
  file_.write_at(data_start_ + place.offset + static_cast<uint64_t>(first) * size, c.data_ptr(),
                 static_cast<size_t>(n) * size);
  place.written.emplace(first, end);
  place.written_elements += n;
}

void SafetensorsFileWriter::commit() {
  for (const auto& [name, place] : places_) {
    TORCH_CHECK(place.written_elements == place.numel, caller_, ": entry '", name, "' has ",
                place.written_elements, " of its ", place.numel, " elements written");
  }
  file_.commit();
}

}  // namespace detail

std::string fp8_scale_name(const std::string& name) {
  return name + "_scale";
}

void save_safetensors(const std::map<std::string, at::Tensor>& tensors, const std::string& path,
                      const std::map<std::string, std::string>& metadata) {
  std::map<std::string, OutEntry> entries;
  for (const auto& [name, t] : tensors) add_tensor(entries, name, t);
  write_entries(entries, path, metadata);
}

void save_safetensors(const SafetensorsContents& contents, const std::string& path) {
  std::map<std::string, OutEntry> entries;
  for (const auto& [name, t] : contents.tensors) add_tensor(entries, name, t);
  for (const auto& [name, t] : contents.fp8) {
    TORCH_CHECK(t.codes.defined() && t.codes.scalar_type() == at::kByte,
                "save_safetensors: FP8 tensor '", name, "' has codes of dtype ",
                t.codes.defined() ? c10::toString(t.codes.scalar_type()) : "(undefined)",
                "; an Fp8Tensor's codes are uint8");
    TORCH_CHECK(t.scale_inv.defined() && t.scale_inv.scalar_type() == at::kFloat &&
                    t.scale_inv.numel() == 1,
                "save_safetensors: FP8 tensor '", name, "' has a scale_inv of ",
                t.scale_inv.defined() ? c10::toString(t.scale_inv.scalar_type()) : "(undefined)",
                t.scale_inv.defined() ? " with " + std::to_string(t.scale_inv.numel()) : "",
                t.scale_inv.defined() ? " elements" : "", "; it must be one float32 element");
    add_entry(entries, name, t.codes, fp8_dtype_name(t.format), "an FP8 tensor");
    add_entry(entries, fp8_scale_name(name), t.scale_inv, "F32",
              "the scale of FP8 tensor '" + name + "'");
  }
  write_entries(entries, path, contents.metadata);
}

}  // namespace ampx
