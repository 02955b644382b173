#pragma once

// What ampx-train's tests share: temp folders, file bytes, error texts,
// environment variables, generated text data.

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <stdlib.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace ampx::train::test {

namespace fs = std::filesystem;

/// A fresh folder under the system's temp folder, removed with everything in it.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "ampx-train-test") {
    std::string pattern = (fs::temp_directory_path() / (prefix + "-XXXXXX")).string();
    TORCH_CHECK(::mkdtemp(pattern.data()) != nullptr, "mkdtemp failed for ", pattern);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

inline std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// Writes `bytes` to `path`, creating its folder.
/// `s` in single quotes for /bin/sh.
inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

/// What a run of a real binary did.
struct BinaryRun {
  int status = -1;  // exit status; -1 if it did not exit normally
  std::string out, err;
};

/// Runs `binary` with `args`, stdout and stderr kept apart in files under `dir`.
inline BinaryRun run_binary_in(const fs::path& dir, const std::string& binary,
                               const std::vector<std::string>& args) {
  const fs::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  std::string cmd = shell_quote(binary);
  for (const auto& a : args) cmd += " " + shell_quote(a);
  cmd += " >" + shell_quote(out.string()) + " 2>" + shell_quote(err.string()) + " </dev/null";
  const int raw = std::system(cmd.c_str());
  BinaryRun r;
  r.status = raw != -1 && WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  r.out = read_bytes(out);
  r.err = read_bytes(err);
  return r;
}

inline void write_bytes(const fs::path& path, const std::string& bytes) {
  if (path.has_parent_path()) fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(out.good(), "cannot write ", path.string());
}

/// <data_dir>/moby-dick/data.txt: `size` characters drawn from `alphabet`
/// with a seeded generator.
inline void write_text_data(const fs::path& data_dir, const std::string& alphabet, size_t size,
                            uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, alphabet.size() - 1);
  std::string text(size, ' ');
  for (auto& c : text) c = alphabet[pick(rng)];
  write_bytes(data_dir / "moby-dick" / "data.txt", text);
}

/// Passes if `text` contains every one of `parts` (the tests link gtest only,
/// not gmock's HasSubstr).
inline testing::AssertionResult contains(const std::string& text,
                                         std::initializer_list<std::string> parts) {
  for (const auto& part : parts) {
    if (text.find(part) == std::string::npos) {
      return testing::AssertionFailure() << "\"" << text << "\"\n  lacks \"" << part << "\"";
    }
  }
  return testing::AssertionSuccess();
}

/// The message of the c10::Error `fn` throws ("" when it throws none),
/// without the C++ backtrace.
inline std::string error_text(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

/// Passes if `fn` throws a c10::Error whose message contains every one of `parts`.
inline testing::AssertionResult expect_error_contains(const std::function<void()>& fn,
                                                      std::initializer_list<std::string> parts) {
  const std::string text = error_text(fn);
  if (text.empty()) return testing::AssertionFailure() << "no c10::Error was thrown";
  return contains(text, parts);
}

/// Sets (or, with nullptr, unsets) an environment variable for one scope.
class EnvGuard {
 public:
  EnvGuard(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~EnvGuard() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace ampx::train::test
