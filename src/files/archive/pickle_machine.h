#pragma once

// check_output_archive_pickle (pickle_machine.cpp): the data.pkl of an
// archive torch::serialize::OutputArchive wrote, run on a pickle machine that
// knows what each stack entry is. check_output_archive (archive_check.h)
// runs it last.

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

namespace ampx {
namespace detail {

/// Throws c10::Error starting with `what` unless `pickle`, the data.pkl of an
/// archive written by torch::serialize::OutputArchive, means only what
/// OutputArchive writes, checked by running it on a pickle machine that
/// tracks what each stack entry is: module objects (__torch__ classes) whose
/// state is a dict of string keys; tensors rebuilt by _rebuild_tensor_v2 from
/// a persistent storage ("storage", torch.<T>Storage, key, location, numel)
/// whose record data/<key> (`storage_bytes`: key -> record size) holds numel
/// elements, with sizes and strides that keep the view inside the storage;
/// ints, floats, bools, strings, None, lists and tuples of them. LibTorch's
/// unpickler trusts the types on its stack (a dict where the storage tuple
/// was crashed LibTorch 1.13: tests/fuzz/README.md).
void check_output_archive_pickle(const char* pickle, size_t size,
                                 const std::map<std::string, uint64_t>& storage_bytes,
                                 const std::string& what);

}  // namespace detail
}  // namespace ampx
