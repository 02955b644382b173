#pragma once

// A small JSON writer for the diagnostics' reports: the library itself does
// not depend on a JSON package (ampx-train and the tests use nlohmann-json).

#include <cmath>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>

namespace ampx {
namespace debug {
namespace detail {

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
}  // namespace debug
}  // namespace ampx
