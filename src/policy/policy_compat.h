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
/// which LibTorch 1.13 prints (8 lines) at every registration that shadows a
/// kernel. Every other warning goes to the previous handler. On 2.x the
/// dispatcher warns once per process (TORCH_WARN_ONCE) and this filter does
/// nothing, so that the one warning is not consumed and later lost for
/// registrations that are not ampx's.
#if AMPX_TORCH_AT_LEAST(2, 0)
class OverrideWarningFilter {};
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
