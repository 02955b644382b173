#include "reader.h"

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <set>
#include <utility>
#include <vector>

namespace ampx {
namespace detail {
namespace {

constexpr int kMaxDepth = 32;
using OrderedJson = nlohmann::ordered_json;

/// `j` as a JsonValue (objects in file order).
JsonValue value_of(const OrderedJson& j) {
  JsonValue v;
  switch (j.type()) {
    case OrderedJson::value_t::null:
    case OrderedJson::value_t::discarded:
      break;
    case OrderedJson::value_t::boolean:
      v.kind = JsonValue::Kind::kBool;
      v.boolean = j.get<bool>();
      break;
    case OrderedJson::value_t::number_integer:
    case OrderedJson::value_t::number_unsigned:
    case OrderedJson::value_t::number_float:
      v.kind = JsonValue::Kind::kNumber;
      v.number = j.get<double>();
      break;
    case OrderedJson::value_t::string:
      v.kind = JsonValue::Kind::kString;
      v.string = j.get<std::string>();
      break;
    case OrderedJson::value_t::array:
      v.kind = JsonValue::Kind::kArray;
      for (const auto& e : j) v.array.push_back(value_of(e));
      break;
    case OrderedJson::value_t::object:
      v.kind = JsonValue::Kind::kObject;
      for (const auto& [key, e] : j.items()) v.object.emplace_back(key, value_of(e));
      break;
    case OrderedJson::value_t::binary:  // not made by parse
      TORCH_INTERNAL_ASSERT(false, "a binary JSON value");
  }
  return v;
}

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
  // A NUL would end nlohmann-json's input, what follows it unread.
  const size_t nul = text.find('\0');
  TORCH_CHECK_VALUE(nul == std::string_view::npos, where, ": not valid JSON at byte ", nul,
                    ": a NUL byte, which JSON text never holds");
  // nlohmann-json reads the text; a key seen twice in one object (which it
  // would take the last of) and nesting deeper than kMaxDepth are refused
  // as it reads.
  std::vector<std::set<std::string>> keys;  // of each object open
  const OrderedJson::parser_callback_t check = [&](int depth, OrderedJson::parse_event_t event,
                                                   OrderedJson& parsed) {
    switch (event) {
      case OrderedJson::parse_event_t::object_start:
      case OrderedJson::parse_event_t::array_start:
        TORCH_CHECK_VALUE(depth < kMaxDepth, where,
                          ": not valid JSON here: more than 32 nested arrays and objects");
        if (event == OrderedJson::parse_event_t::object_start) keys.emplace_back();
        break;
      case OrderedJson::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        TORCH_CHECK_VALUE(!keys.empty() && keys.back().insert(key).second, where,
                          ": not valid JSON here: the key '", key, "' twice in one object");
        break;
      }
      case OrderedJson::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      default:
        break;
    }
    return true;
  };
  std::string error;
  try {
    return value_of(OrderedJson::parse(text.begin(), text.end(), check));
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte: the byte after the one the reader stopped at (1 for the first).
    error =
        c10::str(where, ": not valid JSON at byte ", e.byte > 0 ? e.byte - 1 : 0, ": ", e.what());
  } catch (const nlohmann::json::exception& e) {  // e.g. a number out of double's range
    error = c10::str(where, ": not valid JSON: ", e.what());
  }
  C10_THROW_ERROR(ValueError, error);
}

}  // namespace detail
}  // namespace ampx
