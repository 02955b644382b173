// read_safetensors and read_safetensors_contents (ampx/safetensors.h): the
// header parsed (header_parser.h), then every entry's dtype, shape and byte
// range checked against the file before any tensor is made from it.

#include "ampx/safetensors.h"

#include "../atomic_file.h"
#include "ampx/detail/compat.h"
#include "ampx/fp8/cast.h"
#include "dtypes.h"
#include "header_parser.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ampx {
namespace {

// safetensors' own limit on the header (the Rust reader refuses larger ones).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// "F64, F32, ...": every dtype ampx reads (dtypes.h), for the refusal of another.
std::string dtype_names() {
  std::string names;
  const auto add = [&](const char* name) {
    names += (names.empty() ? "" : ", ") + std::string(name);
  };
  for (const auto& k : detail::kSafetensorsDtypes) add(k.name);
  for (const auto& k : detail::kSafetensorsFp8Dtypes) add(k.name);
  return names;
}

// An entry read: its bytes as a tensor of the dtype's element type (uint8
// for the FP8 dtypes, whose format is then set).
struct InEntry {
  std::string name;
  std::string dtype;
  at::Tensor tensor;
  std::optional<fp8::Fp8Format> fp8;
};

// The file's entries, every one and the byte ranges checked before any
// tensor is made (overlapping entries could otherwise each allocate the
// whole data).
std::vector<InEntry> read_entries(const std::string& path,
                                  std::map<std::string, std::string>& metadata) {
  const std::string where = "read_safetensors: '" + path + "'";
  const auto read = detail::read_file(path);
  TORCH_CHECK(read, "read_safetensors: cannot open '", path, "': ", std::strerror(errno));
  const std::string& file = *read;
  TORCH_CHECK(file.size() >= 8, where, " is not a safetensors file: ", file.size(),
              " bytes, shorter than its 8-byte header length");
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, file.data(), 8);
  TORCH_CHECK(header_bytes <= kMaxHeaderBytes, where, " gives a header of ", header_bytes,
              " bytes; safetensors headers are at most ", kMaxHeaderBytes);
  TORCH_CHECK(header_bytes <= file.size() - 8, where, " is truncated: its header needs ",
              header_bytes, " bytes, the file holds ", file.size() - 8, " after the length");
  std::vector<std::pair<std::string, detail::SafetensorsHeaderEntry>> entries;
  detail::parse_safetensors_header(std::string_view(file).substr(8, header_bytes), where, entries,
                                   metadata);

  const uint64_t data_bytes = file.size() - 8 - header_bytes;
  const char* data = file.data() + 8 + header_bytes;
  std::vector<c10::ScalarType> types;
  std::vector<std::optional<fp8::Fp8Format>> formats;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, e] : entries) {
    std::optional<c10::ScalarType> type;
    std::optional<fp8::Fp8Format> format;
    for (const auto& k : detail::kSafetensorsDtypes) {
      if (e.dtype == k.name) type = k.type;
    }
    for (const auto& k : detail::kSafetensorsFp8Dtypes) {
      if (e.dtype == k.name) {
        type = c10::kByte;  // the codes
        format = k.format;
      }
    }
    TORCH_CHECK(type.has_value(), where, ": tensor '", name, "' has dtype '", e.dtype,
                "', which ampx does not read (", dtype_names(), ")");
    TORCH_CHECK(e.begin <= e.end && e.end <= data_bytes, where, ": tensor '", name,
                "' has data_offsets [", e.begin, ", ", e.end, "] outside the ", data_bytes,
                " bytes of data");
    uint64_t count = 1;
    for (int64_t s : e.shape) {
      TORCH_CHECK(s == 0 || count <= data_bytes / static_cast<uint64_t>(s), where, ": tensor '",
                  name, "' has a shape larger than the file");
      count *= static_cast<uint64_t>(s);
    }
    const uint64_t element = c10::elementSize(*type);
    TORCH_CHECK(count * element == e.end - e.begin, where, ": tensor '", name, "' of shape ",
                c10::IntArrayRef(e.shape), " and dtype ", e.dtype, " needs ", count * element,
                " bytes, its data_offsets give ", e.end - e.begin);
    types.push_back(*type);
    formats.push_back(format);
    ranges.emplace_back(e.begin, e.end);
  }
  std::vector<std::pair<uint64_t, uint64_t>> sorted = ranges;
  std::sort(sorted.begin(), sorted.end());
  uint64_t covered = 0;
  for (const auto& [b, e] : sorted) {
    TORCH_CHECK(b == covered, where, ": its tensors' data ",
                b < covered ? "overlap" : "leave a gap", " at byte ", std::min(b, covered),
                " of the data");
    covered = e;
  }
  TORCH_CHECK(covered == data_bytes, where, ": ", data_bytes - covered,
              " bytes after the last tensor's data belong to no tensor");
  std::vector<InEntry> out;
  out.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    auto& [name, e] = entries[i];
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(types[i]));
    if (e.end > e.begin) std::memcpy(t.data_ptr(), data + e.begin, e.end - e.begin);
    out.push_back({std::move(name), std::move(e.dtype), std::move(t), formats[i]});
  }
  return out;
}

}  // namespace

std::map<std::string, at::Tensor> read_safetensors(const std::string& path,
                                                   std::map<std::string, std::string>* metadata) {
  std::map<std::string, std::string> meta;
  auto entries = read_entries(path, meta);
  std::map<std::string, at::Tensor> out;
  for (auto& e : entries) {
    if (e.fp8) {
#if AMPX_HAS_TORCH_FLOAT8
      e.tensor = fp8::codes_to_torch_float8(e.tensor, *e.fp8);
#else
      TORCH_CHECK(false, "read_safetensors: '", path, "': tensor '", e.name, "' is ", e.dtype,
                  ", and LibTorch ", detail::compat::torch_version(),
                  " has no float8 dtype (2.1 added them); ampx::read_safetensors_contents() "
                  "reads it as an ampx::fp8::Fp8Tensor (uint8 codes, format, scale)");
#endif
    }
    out.emplace(std::move(e.name), std::move(e.tensor));
  }
  if (metadata != nullptr) *metadata = std::move(meta);
  return out;
}

SafetensorsContents read_safetensors_contents(const std::string& path) {
  const std::string where = "read_safetensors: '" + path + "'";
  SafetensorsContents out;
  auto entries = read_entries(path, out.metadata);
  std::map<std::string, const InEntry*> by_name;
  for (const auto& e : entries) by_name.emplace(e.name, &e);
  std::set<std::string> scales;  // the entries that are an FP8 tensor's scale
  for (const auto& e : entries) {
    if (!e.fp8) continue;
    const InEntry* scale = nullptr;
    for (const std::string& name : {fp8_scale_name(e.name), e.name + "_scale_inv"}) {
      const auto it = by_name.find(name);
      if (it == by_name.end()) continue;
      TORCH_CHECK(scale == nullptr, where, ": FP8 tensor '", e.name, "' has two scales, '",
                  scale ? scale->name : "", "' and '", name, "'");
      scale = it->second;
    }
    at::Tensor scale_inv = at::ones({}, at::kFloat);  // no scale: the codes are the values
    if (scale != nullptr) {
      const auto type = scale->tensor.scalar_type();
      TORCH_CHECK(!scale->fp8 && (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf),
                  where, ": '", scale->name, "', the scale of FP8 tensor '", e.name, "', is ",
                  scale->dtype, "; a scale is F32, BF16 or F16");
      TORCH_CHECK(scale->tensor.numel() == 1, where, ": '", scale->name,
                  "', the scale of FP8 tensor '", e.name, "', has shape ", scale->tensor.sizes(),
                  "; ampx reads per-tensor scales (one element), not per-channel or per-block "
                  "ones");
      scale_inv = scale->tensor.to(at::kFloat);  // exact: float32 holds every bf16 and fp16
      scales.insert(scale->name);
    }
    out.fp8.emplace(e.name, fp8::Fp8Tensor{e.tensor, scale_inv, *e.fp8});
  }
  for (auto& e : entries) {
    if (!e.fp8 && !scales.count(e.name)) out.tensors.emplace(e.name, std::move(e.tensor));
  }
  return out;
}

}  // namespace ampx
