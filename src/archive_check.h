#pragma once

// Checks a LibTorch archive (torch.save's zip, or a bare pickle) before
// LibTorch reads it, for files from outside: LibTorch's readers trust the
// length fields they find and allocate what they say (a 4-byte pickle string
// length, a memo index, a zip record's size), so a hostile or damaged file
// could make them reserve gigabytes. Fuzzing found it (tests/fuzz). Not
// installed: not part of ampx's API.
//
//   ampx::detail::check_torch_archive(bytes.data(), bytes.size(), "load_state_dict: 'x.pt'");
//   torch::pickle_load(bytes);  // every length now bounded by the file's size

#include <cstddef>
#include <string>

namespace ampx {
namespace detail {

/// Throws c10::Error starting with `what` unless every zip record (stored,
/// within the file) and every pickle in it (the whole input when it is not
/// a zip) has length fields and memo indices bounded by the bytes there are.
void check_torch_archive(const char* data, size_t size, const std::string& what);

/// The same for one pickle stream.
void check_pickle(const char* data, size_t size, const std::string& what);

}  // namespace detail
}  // namespace ampx
