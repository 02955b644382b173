#pragma once

// Helpers shared by ampx's tests.

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>
#include <string>

namespace ampx {
namespace test {

/// Directory holding the files tests/reference/torch_reference.py wrote
/// (ctest sets AMPX_REFERENCE_DIR; the fixture test generates them).
inline std::string reference_dir() {
  const char* dir = std::getenv("AMPX_REFERENCE_DIR");
  return dir ? dir : AMPX_DEFAULT_REFERENCE_DIR;
}

/// Loads a reference JSON file; a missing file fails the test, it never skips.
inline nlohmann::json load_reference(const std::string& name) {
  const std::string path = reference_dir() + "/" + name;
  std::ifstream in(path);
  if (!in) {
    ADD_FAILURE() << "reference file " << path
                  << " is missing: run tests/reference/torch_reference.py generate "
                  << reference_dir();
    return nlohmann::json();
  }
  return nlohmann::json::parse(in);
}

/// The message of the c10::Error `fn` throws ("" when it throws none),
/// without the C++ backtrace.
template <class F>
std::string error_text(F&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace test
}  // namespace ampx
