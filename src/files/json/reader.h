#pragma once

// A JSON document as a tree, read by nlohmann-json (a header-only
// dependency of the library's sources, not of its headers): objects (keys
// kept in file order, each once), arrays, strings, numbers,
// true/false/null, nesting at most 32 deep. The plan files' reader
// (src/plan/plan_file.cpp) walks it; safetensors headers have a reader of
// their own grammar (safetensors/header_parser.h), and the reports are
// written by writer.h.
//
//   auto v = ampx::detail::parse_json(R"({"a": [1, "x"]})", "load_plan: 'p.json'");
//   v.object[0].first;                    // "a"
//   v.object[0].second.array[0].number;   // 1.0

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ampx {
namespace detail {

/// One JSON value; which member holds it says `kind`.
struct JsonValue {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<JsonValue> array;
  std::vector<std::pair<std::string, JsonValue>> object;
};

/// "null", "boolean", "number", "string", "array", "object".
const char* kind_name(JsonValue::Kind kind);

/// Parses `text`, one JSON value and nothing after it but white space.
/// Errors are c10::Error starting with `where`, naming the byte offset and
/// what was expected there.
JsonValue parse_json(std::string_view text, const std::string& where);

}  // namespace detail
}  // namespace ampx
