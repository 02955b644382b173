#include "json_value.h"

#include <c10/util/Exception.h>

#include <cstdlib>

namespace ampx {
namespace plan {
namespace detail {
namespace {

constexpr int kMaxDepth = 32;

class JsonParser {
 public:
  JsonParser(std::string_view text, const std::string& where) : text_(text), where_(where) {}

  JsonValue document() {
    JsonValue v = value(0);
    skip_space();
    if (pos_ != text_.size()) fail("the end of the text");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& expected) const {
    std::string seen = pos_ < text_.size() ? "'" + std::string(1, text_[pos_]) + "'" : "the end";
    TORCH_CHECK_VALUE(false, where_, ": not valid JSON at byte ", pos_, ": expected ", expected,
                      ", found ", seen);
  }
  void skip_space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' ||
                                   text_[pos_] == '\t' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool take(char c) {
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!take(c)) fail(std::string("'") + c + "'");
  }
  bool word(std::string_view w) {
    if (text_.substr(pos_, w.size()) != w) return false;
    pos_ += w.size();
    return true;
  }

  JsonValue value(int depth) {
    if (depth > kMaxDepth) fail("at most 32 nested arrays and objects");
    skip_space();
    JsonValue v;
    if (pos_ >= text_.size()) fail("a value");
    const char c = text_[pos_];
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') {
      v.kind = JsonValue::Kind::kString;
      v.string = string();
    } else if (word("true") || word("false")) {
      v.kind = JsonValue::Kind::kBool;
      v.boolean = text_[pos_ - 1] == 'e' && text_[pos_ - 2] == 'u';
    } else if (word("null")) {
      v.kind = JsonValue::Kind::kNull;
    } else {
      v.kind = JsonValue::Kind::kNumber;
      v.number = number();
    }
    return v;
  }

  JsonValue object(int depth) {
    JsonValue v;
    v.kind = JsonValue::Kind::kObject;
    expect('{');
    if (take('}')) return v;
    do {
      skip_space();
      if (pos_ >= text_.size() || text_[pos_] != '"') fail("a key (a string)");
      std::string key = string();
      for (const auto& item : v.object) {
        if (item.first == key) fail("a key not seen before in this object, not '" + key + "'");
      }
      expect(':');
      v.object.emplace_back(std::move(key), value(depth + 1));
    } while (take(','));
    expect('}');
    return v;
  }

  JsonValue array(int depth) {
    JsonValue v;
    v.kind = JsonValue::Kind::kArray;
    expect('[');
    if (take(']')) return v;
    do {
      v.array.push_back(value(depth + 1));
    } while (take(','));
    expect(']');
    return v;
  }

  // Strings: the escapes JSON has; \u only for code points below 0x80
  // (what src/files/json/writer.h writes for control characters).
  std::string string() {
    ++pos_;  // the opening quote
    std::string s;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      char c = text_[pos_++];
      if (static_cast<unsigned char>(c) < 0x20) fail("no control character inside a string");
      if (c != '\\') {
        s += c;
        continue;
      }
      if (pos_ >= text_.size()) fail("an escape");
      c = text_[pos_++];
      switch (c) {
        case '"':
        case '\\':
        case '/':
          s += c;
          break;
        case 'n':
          s += '\n';
          break;
        case 't':
          s += '\t';
          break;
        case 'r':
          s += '\r';
          break;
        case 'b':
          s += '\b';
          break;
        case 'f':
          s += '\f';
          break;
        case 'u': {
          const std::string hex(text_.substr(pos_, 4));
          char* end = nullptr;
          const long code = std::strtol(hex.c_str(), &end, 16);
          if (hex.size() != 4 || end != hex.c_str() + 4 || code >= 0x80) {
            fail("\\u and four hex digits below 0080");
          }
          s += static_cast<char>(code);
          pos_ += 4;
          break;
        }
        default:
          --pos_;
          fail("an escape (\\\" \\\\ \\/ \\n \\t \\r \\b \\f \\u)");
      }
    }
    if (pos_ >= text_.size()) fail("'\"' closing the string");
    ++pos_;
    return s;
  }

  double number() {
    const size_t begin = pos_;
    while (pos_ < text_.size() &&
           std::string_view("+-0123456789.eE").find(text_[pos_]) != std::string_view::npos) {
      ++pos_;
    }
    const std::string digits(text_.substr(begin, pos_ - begin));
    char* end = nullptr;
    const double v = digits.empty() ? 0 : std::strtod(digits.c_str(), &end);
    if (digits.empty() || end != digits.c_str() + digits.size()) {
      pos_ = begin;
      fail("a value (object, array, string, number, true, false, null)");
    }
    return v;
  }

  std::string_view text_;
  const std::string& where_;
  size_t pos_ = 0;
};

}  // namespace

const char* kind_name(JsonValue::Kind kind) {
  switch (kind) {
    case JsonValue::Kind::kNull:
      return "null";
    case JsonValue::Kind::kBool:
      return "boolean";
    case JsonValue::Kind::kNumber:
      return "number";
    case JsonValue::Kind::kString:
      return "string";
    case JsonValue::Kind::kArray:
      return "array";
    case JsonValue::Kind::kObject:
      return "object";
  }
  return "?";
}

JsonValue parse_json(std::string_view text, const std::string& where) {
  return JsonParser(text, where).document();
}

}  // namespace detail
}  // namespace plan
}  // namespace ampx
