// Crash-safe file writes (see atomic_file.h).

#include "atomic_file.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>

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

void write_file_atomically(const std::string& path, const void* data, size_t size,
                           const char* caller) {
  const auto* bytes = static_cast<const char*>(data);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, caller, ": cannot write '", path, "': creating its temp file '", tmp,
              "' failed: ", errno_text());
  size_t written = 0;
  while (written < size) {
    const ssize_t n = ::write(fd, bytes + written, size - written);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      const std::string why = errno_text();
      ::close(fd);
      ::unlink(tmp.c_str());
      TORCH_CHECK(false, caller, ": cannot write '", path, "': ", why, " (",
                  left_as_it_was(path, tmp), ")");
    }
    written += static_cast<size_t>(n);
  }
  // The descriptor is closed whether fsync fails or not (no leak per failed save).
  std::string why = ::fsync(fd) != 0 ? errno_text() : std::string();
  if (::close(fd) != 0 && why.empty()) why = errno_text();
  if (!why.empty()) {
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, caller, ": cannot write '", path, "': flushing failed: ", why, " (",
                left_as_it_was(path, tmp), ")");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, caller, ": cannot write '", path, "': renaming '", tmp,
                "' over it failed: ", why, " (", left_as_it_was(path, tmp), ")");
  }
  // Make the rename itself durable.
  const int dir = ::open(dir_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace detail
}  // namespace ampx
