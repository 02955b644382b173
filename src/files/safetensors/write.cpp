// save_safetensors (ampx/safetensors.h): the header written with the
// library's JSON writer, then every tensor's CPU bytes, in one atomic write.

#include "ampx/safetensors.h"

#include "../atomic_file.h"
#include "../json/writer.h"
#include "ampx/detail/compat.h"
#include "ampx/fp8/cast.h"
#include "dtypes.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace ampx {
namespace {

const char* fp8_dtype_name(fp8::Fp8Format format) {
  for (const auto& d : detail::kSafetensorsFp8Dtypes) {
    if (d.format == format) return d.name;
  }
  TORCH_CHECK(false, "save_safetensors: unknown FP8 format ", static_cast<int>(format));
}

const char* dtype_name(c10::ScalarType type, const std::string& tensor) {
  for (const auto& d : detail::kSafetensorsDtypes) {
    if (d.type == type) return d.name;
  }
#if AMPX_HAS_TORCH_FLOAT8
  for (const auto& d : detail::kSafetensorsFp8Dtypes) {
    if (type == fp8::torch_dtype(d.format)) return d.name;
  }
#endif
  TORCH_CHECK(false, "save_safetensors: tensor '", tensor, "' is ", type,
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

void write_entries(const std::map<std::string, OutEntry>& entries, const std::string& path,
                   const std::map<std::string, std::string>& metadata) {
  using detail::json_string;
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      header += (first ? "" : ",") + json_string(k) + ":" + json_string(v);
      first = false;
    }
    header += "}";
  }
  std::vector<at::Tensor> bytes_of;
  uint64_t offset = 0;
  for (const auto& [name, entry] : entries) {
    const at::Tensor c = entry.tensor.detach().to(at::kCPU).contiguous();
    const uint64_t n = static_cast<uint64_t>(c.numel()) * c.element_size();
    header += std::string(header.size() > 1 ? "," : "") + json_string(name) + ":{\"dtype\":\"" +
              entry.dtype + "\",\"shape\":[";
    for (int64_t d = 0; d < c.dim(); ++d) header += (d ? "," : "") + std::to_string(c.size(d));
    header +=
        "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + n) + "]}";
    offset += n;
    bytes_of.push_back(c);
  }
  header += "}";
  // The data start 8-aligned, as the reference writer makes them: spaces pad
  // the header (JSON ignores them).
  header.append((8 - (8 + header.size()) % 8) % 8, ' ');
  std::string file(8, '\0');
  const uint64_t header_bytes = header.size();
  std::memcpy(file.data(), &header_bytes, 8);
  file.reserve(8 + header.size() + offset);
  file += header;
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
