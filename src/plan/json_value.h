#pragma once

// The JSON of plan files, read by nlohmann-json (a header-only dependency
// of the library's sources, not of its headers): objects (keys kept in file
// order, each once), arrays, strings, numbers, true/false/null, nesting at
// most 32 deep. Internal to src/plan/.
//
//   auto v = ampx::plan::detail::parse_json(R"({"a": [1, "x"]})", "load_plan: 'p.json'");
//   v.object[0].first;                    // "a"
//   v.object[0].second.array[0].number;   // 1.0

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ampx {
namespace plan {
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
}  // namespace plan
}  // namespace ampx
