#pragma once

// Little-endian reads over the bytes of an archive from outside, for the
// zip and pickle parsers of src/files/archive/: le() at a place already
// checked, and Cursor, a reader whose reads past the end throw.

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace ampx {
namespace detail {

/// The unsigned little-endian number of `bytes` bytes at p.
inline uint64_t le(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

/// A reader over [data, data + size) whose reads past the end throw.
class Cursor {
 public:
  Cursor(const char* data, size_t size, const std::string& what, const char* kind)
      : p_(reinterpret_cast<const unsigned char*>(data)), size_(size), what_(what), kind_(kind) {}
  size_t left() const { return size_ - at_; }
  size_t at() const { return at_; }
  void need(uint64_t n, const char* field) const {
    TORCH_CHECK(n <= left(), what_, ": damaged ", kind_, ": ", field, " at byte ", at_, " needs ",
                n, " bytes, ", left(), " are left");
  }
  uint64_t u(int bytes, const char* field) {
    need(bytes, field);
    const uint64_t v = le(p_ + at_, bytes);
    at_ += bytes;
    return v;
  }
  void skip(uint64_t n, const char* field) {
    need(n, field);
    at_ += n;
  }
  /// Skips a text argument ended by '\n' (protocol 0 opcodes).
  void line(const char* field) {
    const void* nl = std::memchr(p_ + at_, '\n', left());
    TORCH_CHECK(nl != nullptr, what_, ": damaged ", kind_, ": ", field, " at byte ", at_,
                " has no end of line");
    at_ = static_cast<const unsigned char*>(nl) - p_ + 1;
  }

 private:
  const unsigned char* p_;
  size_t size_, at_ = 0;
  const std::string& what_;
  const char* kind_;
};

}  // namespace detail
}  // namespace ampx
