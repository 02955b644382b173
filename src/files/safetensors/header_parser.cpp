// parse_safetensors_header (header_parser.h): a recursive-descent parser of
// the safetensors header's subset of JSON, every failure an error that names
// the file and the byte offset in the header.

#include "header_parser.h"

#include <c10/util/Exception.h>

#include <limits>
#include <set>

namespace ampx {
namespace detail {
namespace {

class HeaderParser {
 public:
  HeaderParser(std::string_view text, std::string where) : s_(text), where_(std::move(where)) {}

  using Entry = SafetensorsHeaderEntry;

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

}  // namespace

void parse_safetensors_header(std::string_view text, const std::string& where,
                              std::vector<std::pair<std::string, SafetensorsHeaderEntry>>& entries,
                              std::map<std::string, std::string>& metadata) {
  HeaderParser(text, where).parse(entries, metadata);
}

}  // namespace detail
}  // namespace ampx
