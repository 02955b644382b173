#pragma once

// Version differences the cast-policy registry needs (src/policy/): the
// warning-handler API changed between LibTorch 1.13 and 2.x.
//
//   { detail::OverrideWarningFilter quiet;  dispatcher.registerImpl(...); }

#include "ampx/detail/compat.h"

#include <c10/util/Exception.h>

#include <string>

namespace ampx {
namespace detail {

/// While alive, drops on this thread the dispatcher's "Overriding a previously
/// registered kernel for the same operator and the same dispatch key" warning,
/// which LibTorch prints (8 lines) when a registration shadows a kernel:
/// 1.13 at every one, 2.x at the first of a process ("Warning only once for
/// all operators", though ampx-train's console showed it twice). ampx's cast
/// policies replace PyTorch's autocast kernels on purpose, and users read the
/// warning as a bug (issue 66). Every other warning goes to the previous
/// handler. (On 2.x the dropped warning is the process's one: a later
/// override that is not ampx's may then print none.)
#if AMPX_TORCH_AT_LEAST(2, 0)
class OverrideWarningFilter final : public c10::WarningHandler {
 public:
  OverrideWarningFilter() : prev_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
  }
  ~OverrideWarningFilter() override { c10::WarningUtils::set_warning_handler(prev_); }
  OverrideWarningFilter(const OverrideWarningFilter&) = delete;
  OverrideWarningFilter& operator=(const OverrideWarningFilter&) = delete;

  void process(const c10::Warning& warning) override {
    if (warning.msg().find("Overriding a previously registered kernel") != std::string::npos) {
      return;
    }
    prev_->process(warning);
  }

 private:
  c10::WarningHandler* prev_;
};
#else
class OverrideWarningFilter final : public c10::WarningHandler {
 public:
  OverrideWarningFilter() : prev_(c10::Warning::get_warning_handler()) {
    c10::Warning::set_warning_handler(this);
  }
  ~OverrideWarningFilter() override { c10::Warning::set_warning_handler(prev_); }
  OverrideWarningFilter(const OverrideWarningFilter&) = delete;
  OverrideWarningFilter& operator=(const OverrideWarningFilter&) = delete;

  void process(const c10::SourceLocation& location, const std::string& msg,
               const bool verbatim) override {
    if (msg.find("Overriding a previously registered kernel") != std::string::npos) return;
    prev_->process(location, msg, verbatim);
  }

 private:
  c10::WarningHandler* prev_;
};
#endif

}  // namespace detail
}  // namespace ampx
