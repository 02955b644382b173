#pragma once

// The names of an OutputArchive's module classes, which its TorchScript
// source declares (check_attribute_module_source, module_source.cpp) and
// its data.pkl names as globals (check_output_archive_pickle).

#include <string>

namespace ampx {
namespace detail {

/// Whether `global`, a pickle global as "module name", is one of the module
/// classes OutputArchive writes: "__torch__ Module" or
/// "__torch__.___torch_mangle_<N> Module".
bool module_class(const std::string& global);

}  // namespace detail
}  // namespace ampx
