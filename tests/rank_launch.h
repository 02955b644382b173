#pragma once

// Starts the ranks of a multi-process test on loopback with torchrun's
// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and
// waits for them, bounded in time (dist_test.cpp, fsdp_test.cpp); the
// folder they write into, and the bytes of what they wrote.

#include <ampx/dist.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace ampx_test {

struct Worker {
  pid_t pid = -1;
  int status = -1;  // exit code, -1 if killed or still running
  std::string output;
  std::filesystem::path out, log;
};

/// Whether rank 0 could not serve the store: another process took the port.
inline bool port_taken(const Worker& w) {
  return w.status != 0 &&
         w.output.find("cannot serve the rendezvous store on port") != std::string::npos;
}

/// Starts `world` processes `binary <scenario> <dir>/<scenario>-<rank>.out`
/// and waits (at most `limit`) for all; each one's output is in its log.
inline std::vector<Worker> launch_ranks(const std::string& binary, const std::filesystem::path& dir,
                                        const std::string& scenario, int world,
                                        std::chrono::seconds limit) {
  const std::string port = std::to_string(ampx::dist::free_loopback_port());
  std::vector<Worker> workers(world);
  for (int r = 0; r < world; ++r) {
    auto& w = workers[r];
    w.out = dir / (scenario + "-" + std::to_string(r) + ".out");
    w.log = dir / (scenario + "-" + std::to_string(r) + ".log");
    w.pid = ::fork();
    if (w.pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      ::setenv("OMP_NUM_THREADS", "1", 1);
      // One path for the 16-bit CPU products on every rank: timed in each
      // process (auto), two ranks on a loaded machine may take two paths.
      ::setenv("AMPX_CPU_PRODUCTS", "native", 0);
      if (!std::freopen(w.log.c_str(), "w", stdout) || !std::freopen(w.log.c_str(), "a", stderr)) {
        ::_exit(126);
      }
      ::execl(binary.c_str(), binary.c_str(), scenario.c_str(), w.out.c_str(), nullptr);
      ::_exit(127);
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (auto& w : workers) {
    int status = 0;
    while (::waitpid(w.pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        for (auto& other : workers) ::kill(other.pid, SIGKILL);
        ::waitpid(w.pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    w.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::ifstream in(w.log);
    w.output.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (&w == &workers[0] && port_taken(w)) {  // the others would wait for the store
      for (auto& other : workers) {
        if (&other != &w) ::kill(other.pid, SIGKILL);
      }
    }
  }
  return workers;
}

/// launch_ranks, again on another port (at most three times) when another
/// process (a concurrent test's Gloo connection, say) took the free port
/// before rank 0's store bound it.
inline std::vector<Worker> run_ranks(const std::string& binary, const std::filesystem::path& dir,
                                     const std::string& scenario, int world,
                                     std::chrono::seconds limit = std::chrono::seconds(120)) {
  for (int attempt = 1;; ++attempt) {
    auto workers = launch_ranks(binary, dir, scenario, world, limit);
    if (attempt == 3 || !port_taken(workers[0])) return workers;
  }
}

/// A new folder under the system's temp folder, named `prefix`-XXXXXX,
/// removed with what it holds when this goes.
class TempFolder {
 public:
  explicit TempFolder(const std::string& prefix) {
    std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      throw std::runtime_error("cannot make a temp folder " + pattern);
    }
    path_ = pattern;
  }
  ~TempFolder() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempFolder(const TempFolder&) = delete;
  TempFolder& operator=(const TempFolder&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// The bytes of the file at `path` ("" if there is none).
inline std::string file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace ampx_test
