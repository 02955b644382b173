#pragma once

// The message a call throws, for tests that pin error texts: shared by the
// library's tests (test_util.h) and ampx-train's (train/test_support.h).
//
//   EXPECT_THAT(ampx::test::error_text([&] { scaler.step(opt); }), HasSubstr("unscale_"));

#include <c10/util/Exception.h>

#include <string>

namespace ampx {
namespace test {

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
