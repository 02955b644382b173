// safetensors files (ampx/safetensors.h). The header is read by a parser of
// the format's own subset of JSON (one object of tensor entries and an
// optional "__metadata__" object of strings; arrays of integers): the library
// keeps no JSON package (src/json/writer.h), and a fixed grammar of
// bounded depth is simpler to make safe against hostile files than a general
// parser (tests/fuzz: target safetensors).

#include "ampx/safetensors.h"

#include "ampx/detail/compat.h"
#include "ampx/fp8/cast.h"
#include "atomic_file.h"
#include "json/writer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

namespace ampx {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian bytes; ampx writes them as they are in memory");

// safetensors' own limit on the header (the Rust reader refuses larger ones).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DtypeName {
  const char* name;
  c10::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"F64", c10::kDouble}, {"F32", c10::kFloat}, {"F16", c10::kHalf},  {"BF16", c10::kBFloat16},
    {"I64", c10::kLong},   {"I32", c10::kInt},   {"I16", c10::kShort}, {"I8", c10::kChar},
    {"U8", c10::kByte},    {"BOOL", c10::kBool},
};

// The FP8 dtypes: one byte per element, read as uint8 codes with their format.
struct Fp8DtypeName {
  const char* name;
  fp8::Fp8Format format;
};
constexpr Fp8DtypeName kFp8Dtypes[] = {
    {"F8_E4M3", fp8::Fp8Format::kE4M3},
    {"F8_E5M2", fp8::Fp8Format::kE5M2},
};

const char* fp8_dtype_name(fp8::Fp8Format format) {
  for (const auto& d : kFp8Dtypes) {
    if (d.format == format) return d.name;
  }
  TORCH_CHECK(false, "save_safetensors: unknown FP8 format ", static_cast<int>(format));
}

const char* dtype_name(c10::ScalarType type, const std::string& tensor) {
  for (const auto& d : kDtypes) {
    if (d.type == type) return d.name;
  }
#if AMPX_HAS_TORCH_FLOAT8
  for (const auto& d : kFp8Dtypes) {
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

// An entry read: its bytes as a tensor of the dtype's element type (uint8
// for the FP8 dtypes, whose format is then set).
struct InEntry {
  std::string name;
  std::string dtype;
  at::Tensor tensor;
  std::optional<fp8::Fp8Format> fp8;
};

// The header's subset of JSON, parsed with every failure an error that names
// the file and the byte offset in the header.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, std::string where) : s_(text), where_(std::move(where)) {}

  struct Entry {
    std::string dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;
  };

  void parse(std::vector<std::pair<std::string, Entry>>& entries,
             std::map<std::string, std::string>& metadata) {
    expect('{');
    std::set<std::string> seen;
    if (!consume('}')) {
      do {
        std::string name = string();
        TORCH_CHECK(seen.insert(name).second, where_, ": the header names '", name, "' twice");
        expect(':');
        if (name == "__metadata__") {
          metadata_object(metadata);
        } else {
          entries.emplace_back(std::move(name), entry());
        }
      } while (consume(','));
      expect('}');
    }
    skip_space();
    TORCH_CHECK(i_ == s_.size(), where_, ": text after the header's object at byte ", i_);
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    TORCH_CHECK(false, where_, ": ", what, " at byte ", i_, " of its header");
  }
  void skip_space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r'))
      ++i_;
  }
  bool consume(char c) {
    skip_space();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!consume(c)) fail(std::string("expected '") + c + "'");
  }

  uint32_t hex4() {
    if (s_.size() - i_ < 4) fail("a \\u escape cut short");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s_[i_++];
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= static_cast<uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v |= static_cast<uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        v |= static_cast<uint32_t>(c - 'A' + 10);
      } else {
        fail("a \\u escape with a non-hex digit");
      }
    }
    return v;
  }
  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("a string without its closing quote");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("a string without its closing quote");
      const char e = s_[i_++];
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {  // a surrogate pair
            if (s_.size() - i_ < 2 || s_[i_] != '\\' || s_[i_ + 1] != 'u') {
              fail("a lone high surrogate");
            }
            i_ += 2;
            const uint32_t lo = hex4();
            if (lo < 0xDC00 || lo >= 0xE000) fail("a high surrogate without its low one");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            fail("a lone low surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default:
          fail(std::string("an unknown escape \\") + e);
      }
    }
  }

  uint64_t integer() {
    skip_space();
    const size_t start = i_;
    uint64_t v = 0;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
      const uint64_t digit = static_cast<uint64_t>(s_[i_] - '0');
      if (v > (static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - digit) / 10) {
        fail("an integer too large");
      }
      v = v * 10 + digit;
      ++i_;
    }
    if (i_ == start) fail("expected a non-negative integer");
    return v;
  }

  std::vector<uint64_t> integers() {
    expect('[');
    std::vector<uint64_t> out;
    if (consume(']')) return out;
    do {
      if (out.size() >= 64) fail("more than 64 dimensions");
      out.push_back(integer());
    } while (consume(','));
    expect(']');
    return out;
  }

  void metadata_object(std::map<std::string, std::string>& metadata) {
    expect('{');
    if (consume('}')) return;
    do {
      std::string key = string();
      expect(':');
      metadata[std::move(key)] = string();
    } while (consume(','));
    expect('}');
  }

  Entry entry() {
    Entry e;
    bool dtype = false, shape = false, offsets = false;
    expect('{');
    if (!consume('}')) {
      do {
        const std::string key = string();
        expect(':');
        if (key == "dtype" && !dtype) {
          e.dtype = string();
          dtype = true;
        } else if (key == "shape" && !shape) {
          for (uint64_t d : integers()) e.shape.push_back(static_cast<int64_t>(d));
          shape = true;
        } else if (key == "data_offsets" && !offsets) {
          const auto o = integers();
          if (o.size() != 2) fail("data_offsets that are not [begin, end]");
          e.begin = o[0];
          e.end = o[1];
          offsets = true;
        } else {
          fail("an unexpected or repeated key '" + key + "' in a tensor entry");
        }
      } while (consume(','));
      expect('}');
    }
    if (!dtype || !shape || !offsets) fail("a tensor entry without dtype, shape and data_offsets");
    return e;
  }

  std::string_view s_;
  std::string where_;
  size_t i_ = 0;
};

std::map<std::string, at::Tensor> named_tensors(const torch::nn::Module& module) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) out[p.key()] = p.value();
  for (const auto& b : module.named_buffers(/*recurse=*/true)) out[b.key()] = b.value();
  return out;
}

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
  std::vector<std::pair<std::string, HeaderParser::Entry>> entries;
  HeaderParser(std::string_view(file).substr(8, header_bytes), where).parse(entries, metadata);

  const uint64_t data_bytes = file.size() - 8 - header_bytes;
  const char* data = file.data() + 8 + header_bytes;
  std::vector<c10::ScalarType> types;
  std::vector<std::optional<fp8::Fp8Format>> formats;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, e] : entries) {
    std::optional<c10::ScalarType> type;
    std::optional<fp8::Fp8Format> format;
    for (const auto& k : kDtypes) {
      if (e.dtype == k.name) type = k.type;
    }
    for (const auto& k : kFp8Dtypes) {
      if (e.dtype == k.name) {
        type = c10::kByte;  // the codes
        format = k.format;
      }
    }
    TORCH_CHECK(type.has_value(), where, ": tensor '", name, "' has dtype '", e.dtype,
                "', which ampx does not read (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, "
                "F8_E4M3, F8_E5M2)");
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

void save_safetensors(const torch::nn::Module& module, const std::string& path,
                      const std::map<std::string, std::string>& metadata) {
  save_safetensors(named_tensors(module), path, metadata);
}

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

void load_safetensors(torch::nn::Module& module, const std::string& path) {
  const std::string where = "load_safetensors: '" + path + "'";
  auto contents = read_safetensors_contents(path);
  std::map<std::string, at::Tensor>& file = contents.tensors;
  for (const auto& [name, t] : contents.fp8) file.emplace(name, t.dequantize());  // float32 values
  const auto mine = named_tensors(module);
  std::string missing, unexpected;
  for (const auto& [name, t] : mine) {
    if (!file.count(name)) missing += (missing.empty() ? "" : ", ") + name;
  }
  for (const auto& [name, t] : file) {
    if (!mine.count(name)) unexpected += (unexpected.empty() ? "" : ", ") + name;
  }
  TORCH_CHECK(missing.empty() && unexpected.empty(), where,
              " does not fit this module:", missing.empty() ? "" : " missing " + missing + ";",
              unexpected.empty() ? "" : " unexpected " + unexpected + ";");
  for (const auto& [name, t] : mine) {
    const auto& src = file.at(name);
    TORCH_CHECK(src.sizes() == t.sizes(), where, ": tensor '", name, "' has shape ", src.sizes(),
                " in the file and ", t.sizes(), " in the module");
    TORCH_CHECK(!contents.fp8.count(name) || t.is_floating_point(), where, ": FP8 tensor '", name,
                "' goes into a floating-point tensor; the module's is ", t.scalar_type());
  }
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : mine) {
    at::Tensor dst = t;
    dst.copy_(file.at(name));  // converting the dtype, as load_state_dict does
  }
}

}  // namespace ampx
