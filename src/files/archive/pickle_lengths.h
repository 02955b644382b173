#pragma once

// check_pickle (pickle_lengths.cpp): the length fields and memo indices of
// one pickle stream, bounded by the bytes there are, before LibTorch's
// unpickler allocates what they say. check_torch_archive (archive_check.h)
// runs it on every pickle of an archive.

#include <cstddef>
#include <string>

namespace ampx {
namespace detail {

/// Throws c10::Error starting with `what` unless every length field, frame
/// and text argument of the pickle [data, data + size) fits the bytes left
/// and every memo index the entries stored so far.
void check_pickle(const char* data, size_t size, const std::string& what);

}  // namespace detail
}  // namespace ampx
