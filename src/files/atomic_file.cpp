// Crash-safe file writes (see atomic_file.h).

#include "atomic_file.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>

#include <fcntl.h>
#include <unistd.h>

namespace ampx {
namespace detail {
namespace {

std::string errno_text() {
  return std::strerror(errno);
}

std::string dir_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) {
    return ".";
  }
  return slash == 0 ? "/" : path.substr(0, slash);
}

/// What a failed write leaves: the old file, and no temp file.
std::string left_as_it_was(const std::string& path, const std::string& tmp) {
  return "temp file '" + tmp + "' removed; '" + path + "' is as it was";
}

}  // namespace

AtomicFile::AtomicFile(std::string path, const char* caller)
    : path_(std::move(path)),
      tmp_(path_ + ".tmp." + std::to_string(::getpid())),
      caller_(caller),
      fd_(::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) {
  TORCH_CHECK(fd_ >= 0, caller_, ": cannot write '", path_, "': creating its temp file '", tmp_,
              "' failed: ", errno_text());
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFile::fail(const std::string& what) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_.c_str());
  TORCH_CHECK(false, caller_, ": cannot write '", path_, "': ", what, " (",
              left_as_it_was(path_, tmp_), ")");
}

void AtomicFile::write_at(uint64_t offset, const void* data, size_t size) {
  TORCH_CHECK(fd_ >= 0, caller_, ": cannot write '", path_, "': the file is closed");
  const auto* bytes = static_cast<const char*>(data);
  size_t written = 0;
  while (written < size) {
    const ssize_t n =
        ::pwrite(fd_, bytes + written, size - written, static_cast<off_t>(offset + written));
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) fail("the system wrote no byte");
    if (n < 0) fail(errno_text());
    written += static_cast<size_t>(n);
  }
}

void AtomicFile::commit() {
  TORCH_CHECK(fd_ >= 0, caller_, ": cannot write '", path_, "': the file is closed");
  // The descriptor is closed whether fsync fails or not (no leak per failed save).
  std::string why = ::fsync(fd_) != 0 ? errno_text() : std::string();
  if (::close(fd_) != 0 && why.empty()) why = errno_text();
  fd_ = -1;
  if (!why.empty()) fail("flushing failed: " + why);
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    fail("renaming '" + tmp_ + "' over it failed: " + errno_text());
  }
  // Make the rename itself durable.
  const int dir = ::open(dir_of(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

void write_file_atomically(const std::string& path, const void* data, size_t size,
                           const char* caller) {
  AtomicFile file(path, caller);
  file.write_at(0, data, size);
  file.commit();
}

std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace detail
}  // namespace ampx
