#pragma once

// What ampx-train's tests share: temp folders, file bytes, error texts,
// environment variables, generated text data.

#include "../error_text.h"
#include "cli/config.h"
#include "run/checkpoint.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/serialize.h>

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ampx::train::test {

namespace fs = std::filesystem;

/// ampx-train's settings for `flags` (without the program's name), parsed
/// and resolved as the binary does: a flag CLI11 refuses fails the test,
/// resolve_defaults' errors are thrown.
inline TrainConfig resolved_config(const std::vector<std::string>& flags) {
  std::vector<const char*> argv = {"ampx-train"};
  for (const auto& f : flags) argv.push_back(f.c_str());
  TrainConfig config;
  EXPECT_FALSE(parse_command_line(static_cast<int>(argv.size()), argv.data(), config));
  resolve_defaults(config);
  return config;
}

/// ampx-train's flags for a gpt small enough to train in a moment (1 layer,
/// d 16, 2 heads, context 8, batch 4, one eval batch, one thread, no
/// progress line). Each of `flags` ({"--steps", "3"}, ...) replaces the
/// default of the same name or comes after them; an empty value leaves the
/// flag out (ampx-train's own default).
inline std::vector<std::string> tiny_gpt(
    const std::vector<std::pair<std::string, std::string>>& flags = {}) {
  std::vector<std::pair<std::string, std::string>> all = {
      {"--workload", "gpt"},   {"--layers", "1"},     {"--d-model", "16"},
      {"--heads", "2"},        {"--block-size", "8"}, {"--batch-size", "4"},
      {"--eval-batches", "1"}, {"--threads", "1"},    {"--progress", "none"}};
  for (const auto& flag : flags) {
    const auto same =
        std::find_if(all.begin(), all.end(), [&](const auto& f) { return f.first == flag.first; });
    if (same != all.end()) {
      same->second = flag.second;
    } else {
      all.push_back(flag);
    }
  }
  std::vector<std::string> args;
  for (const auto& [name, value] : all) {
    if (value.empty()) continue;
    args.push_back(name);
    args.push_back(value);
  }
  return args;
}

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

/// `s` in single quotes for /bin/sh.
/// Lines of a text file (a metrics file: one record per step).
inline int64_t lines_in(const fs::path& path) {
  std::ifstream in(path);
  int64_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

/// One numeric field of every record of a JSON-lines metrics file.
inline std::vector<double> metrics_field(const fs::path& path, const std::string& field) {
  std::vector<double> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    out.push_back(nlohmann::json::parse(line).at(field).get<double>());
  }
  return out;
}

/// Every step's loss in a JSON-lines metrics file.
inline std::vector<double> losses_in_metrics(const fs::path& path) {
  return metrics_field(path, "loss");
}

/// A metrics-<mode>.jsonl file, column by column, and the steps the loss
/// scaler skipped.
struct Metrics {
  std::vector<int64_t> steps;
  std::vector<double> losses, scales, step_ms;
  std::vector<int64_t> skipped_steps;
};

inline Metrics read_metrics(const fs::path& path) {
  Metrics out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto r = nlohmann::json::parse(line);
    out.steps.push_back(r.at("step"));
    out.losses.push_back(r.at("loss"));
    out.scales.push_back(r.at("scale"));
    out.step_ms.push_back(r.at("step_ms"));
    if (r.at("skipped").get<bool>()) out.skipped_steps.push_back(out.steps.back());
  }
  return out;
}

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

/// Writes `bytes` to `path`, creating its folder.
inline void write_bytes(const fs::path& path, const std::string& bytes) {
  if (path.has_parent_path()) fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(out.good(), "cannot write ", path.string());
}

#ifdef AMPX_TRAIN_BINARY

/// How a background ampx-train run ended.
struct Exit {
  int status = -1;  // exit code, or -1 when killed by a signal
  bool killed = false;
  std::string output;  // stdout + stderr
};

/// Starts ampx-train with `args` in a process group of its own (its ranks
/// too), stdout and stderr to `log`; returns its pid. `env` ("NAME=value")
/// goes in front of the inherited environment (the first of a name wins).
inline pid_t spawn_train(const std::vector<std::string>& args, const fs::path& log,
                         const std::vector<std::string>& env = {}) {
  // argv and envp are built before fork: the child only execs.
  std::vector<std::string> strings{AMPX_TRAIN_BINARY};
  strings.insert(strings.end(), args.begin(), args.end());
  std::vector<char*> argv, envp;
  for (auto& s : strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::vector<std::string> environment = env;
  for (char** e = environ; *e != nullptr; ++e) environment.emplace_back(*e);
  for (auto& e : environment) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::execve(AMPX_TRAIN_BINARY, argv.data(), envp.data());
    ::_exit(127);
  }
  return pid;
}

/// Waits for spawn_train's `pid`; past `limit`, SIGKILLs its process group
/// (a hung run fails its test instead of hanging the suite).
inline Exit wait_train(pid_t pid, const fs::path& log,
                       std::chrono::seconds limit = std::chrono::seconds(300)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  Exit e;
  e.killed = WIFSIGNALED(status);
  e.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  e.output = read_bytes(log);
  return e;
}

inline Exit run_train(const std::vector<std::string>& args, const fs::path& log) {
  return wait_train(spawn_train(args, log), log);
}

/// SIGKILLs (and continues) spawn_train's process group when it goes out of
/// scope, whatever a failed assertion skipped: no rank outlives its test.
class KillGroupGuard {
 public:
  explicit KillGroupGuard(pid_t pid) : pid_(pid) {}
  ~KillGroupGuard() {
    ::kill(-pid_, SIGKILL);
    ::kill(-pid_, SIGCONT);
    int status = 0;
    ::waitpid(pid_, &status, 0);  // at once: killed, or reaped already
  }
  KillGroupGuard(const KillGroupGuard&) = delete;
  KillGroupGuard& operator=(const KillGroupGuard&) = delete;

 private:
  pid_t pid_;
};

/// Waits until `metrics` has `lines` lines or `pid` ended; false if it ended.
inline bool wait_for_lines(pid_t pid, const fs::path& metrics, int64_t lines) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (lines_in(metrics) < lines && std::chrono::steady_clock::now() < deadline) {
    siginfo_t info{};
    if (::waitid(P_PID, pid, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid != 0) {
      return false;  // it ended (reaped later by wait_train)
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

/// The pids of ampx-train's ranks under `parent` (RANK= in their environment), by rank.
inline std::vector<pid_t> ranks_of(pid_t parent, int nproc) {
  std::vector<pid_t> pids(nproc, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::count(pids.begin(), pids.end(), 0) > 0 &&
         std::chrono::steady_clock::now() < deadline) {
    for (const auto& e : fs::directory_iterator("/proc")) {
      const std::string name = e.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream stat(e.path() / "stat");
      std::string line;
      std::getline(stat, line);
      // pid (comm) state ppid ...
      const auto close = line.rfind(')');
      if (close == std::string::npos) continue;
      std::istringstream rest(line.substr(close + 2));
      std::string state;
      pid_t ppid = 0;
      rest >> state >> ppid;
      if (ppid != parent) continue;
      const std::string env =
          std::string(1, '\0') + ampx::train::test::read_bytes(e.path() / "environ");
      const auto at = env.find(std::string("\0RANK=", 6));
      if (at == std::string::npos) continue;
      const int rank = std::stoi(env.substr(at + 6));
      if (rank >= 0 && rank < nproc) pids[rank] = std::stoi(name);
    }
  }
  return pids;
}

#endif  // AMPX_TRAIN_BINARY

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

using ::ampx::test::error_text;

/// Passes if `fn` throws a c10::Error whose message contains every one of `parts`.
inline testing::AssertionResult expect_error_contains(const std::function<void()>& fn,
                                                      std::initializer_list<std::string> parts) {
  const std::string text = error_text(fn);
  if (text.empty()) return testing::AssertionFailure() << "no c10::Error was thrown";
  return contains(text, parts);
}

inline void collect_tensors(torch::serialize::InputArchive& archive, const std::string& prefix,
                            std::vector<std::pair<std::string, torch::Tensor>>& out) {
  for (const auto& key : archive.keys()) {
    c10::IValue value;
    if (archive.try_read(key, value) && value.isTensor()) {
      out.emplace_back(prefix + key, value.toTensor());
      continue;
    }
    torch::serialize::InputArchive child;  // a submodule
    if (archive.try_read(key, child)) collect_tensors(child, prefix + key + ".", out);
  }
}

/// The model parameters and buffers an ampx-train checkpoint holds, by name, as stored.
inline std::vector<std::pair<std::string, torch::Tensor>> model_tensors(const fs::path& path) {
  const auto c = read_checkpoint(path);
  std::istringstream payload(c.payload);
  torch::serialize::InputArchive archive, model;
  archive.load_from(payload);
  archive.read("model", model);
  std::vector<std::pair<std::string, torch::Tensor>> out;
  collect_tensors(model, "", out);
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.first < b.first; });
  return out;
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
