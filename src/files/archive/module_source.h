#pragma once

// The TorchScript source of an OutputArchive's modules: the check that it
// holds only what OutputArchive writes (check_attribute_module_source), and
// the names of its module classes, which that source declares and data.pkl
// names as globals (module_class, for check_output_archive_pickle).

#include <string>

namespace ampx {
namespace detail {

/// Throws c10::Error starting with `what` unless `source`, the TorchScript
/// source record `name` of an archive written by torch::serialize::
/// OutputArchive, holds only what OutputArchive writes: one attribute-only
/// class,
///
///   class Module(Module):
///     __parameters__ = ["weight", ]
///     __buffers__ = []
///     weight : Tensor
///     sub : __torch__.___torch_mangle_3.Module
///     __annotations__["group0.lr"] = float
///
/// with names in double quotes or identifiers and types among Tensor, int,
/// float, bool, str, Optional/List of those, and the archive's own module
/// classes. LibTorch's TorchScript importer compiles this source before any
/// value is read, and LibTorch 1.13's crashes on some malformed class bodies
/// (a class constant where an attribute list was: tests/fuzz/README.md).
void check_attribute_module_source(const std::string& name, const std::string& source,
                                   const std::string& what);

/// Whether `global`, a pickle global as "module name", is one of the module
/// classes OutputArchive writes: "__torch__ Module" or
/// "__torch__.___torch_mangle_<N> Module".
bool module_class(const std::string& global);

}  // namespace detail
}  // namespace ampx
