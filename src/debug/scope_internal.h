#pragma once

// What the diagnostics need from the scopes beyond the public header: the
// scope stack itself, parameter names, and the map from autograd sequence
// numbers to the scope their forward op ran in (backward attribution).

#include <c10/core/TensorImpl.h>

#include <cstdint>
#include <string>

namespace ampx {
namespace debug {
namespace detail {

void push_scope(std::string name);
void pop_scope();
/// Innermost scope of this thread, "" when none.
const std::string& innermost_scope();

/// Whether any diagnostic records scopes (then push/pop log sequence numbers).
void set_recording(bool on);

/// The scope in which the forward op that created the autograd node with
/// `sequence_nr` ran on thread `forward_thread` (RecordFunction's ids), ""
/// when unknown.
std::string scope_of_sequence_nr(uint64_t forward_thread, int64_t sequence_nr);

/// Name of a named parameter: its module's path and its own full name, or
/// nullptr when `impl` is not one. The pointer stays valid until the next
/// name_modules()/clear_module_names().
struct ParameterName {
  std::string module_path;
  std::string full_name;
};
bool parameter_name(const c10::TensorImpl* impl, ParameterName* out);
/// Cheap test: whether name_modules() registered any parameter.
bool any_parameter_named();

}  // namespace detail
}  // namespace debug
}  // namespace ampx
