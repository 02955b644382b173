#pragma once

// A small JSON writer: strings and numbers as JSON text, for the
// diagnostics' reports (src/debug/) and plan files (src/plan/), which lay
// their text out themselves (a plan: one key a line, diffable) and write
// non-finite numbers as strings ("inf", "nan") where nlohmann-json's dump()
// writes null; strings' bytes go out as they are. Reading is reader.h's
// (nlohmann-json), as are safetensors headers both ways.
//
//   ampx::detail::json_string("say \"hi\"");  // the text "say \"hi\"", quotes included
//   ampx::detail::json_number(0.1);          // 0.10000000000000001
//   ampx::detail::json_number(INFINITY);     // "inf"

#include <cmath>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>

namespace ampx {
namespace detail {

/// `s` as a JSON string, quoted, with quotes, backslashes and control
/// characters escaped (bytes from 0x80 as they are: UTF-8 passes through).
inline std::string json_string(const std::string& s) {
  std::ostringstream o;
  o << '"';
  for (const unsigned char c : s) {
    switch (c) {
      case '"':
        o << "\\\"";
        break;
      case '\\':
        o << "\\\\";
        break;
      case '\n':
        o << "\\n";
        break;
      case '\t':
        o << "\\t";
        break;
      default:
        if (c < 0x20) {
          o << "\\u" << std::hex << std::setw(4) << std::setfill('0') << static_cast<int>(c)
            << std::dec;
        } else {
          o << c;
        }
    }
  }
  o << '"';
  return o.str();
}

/// Shortest text that reads back as the same double; non-finite as strings
/// ("inf", "-inf", "nan"), which JSON has no numbers for.
inline std::string json_number(double v) {
  if (std::isnan(v)) return "\"nan\"";
  if (std::isinf(v)) return v > 0 ? "\"inf\"" : "\"-inf\"";
  std::ostringstream o;
  o << std::setprecision(std::numeric_limits<double>::max_digits10) << v;
  return o.str();
}

}  // namespace detail
}  // namespace ampx
