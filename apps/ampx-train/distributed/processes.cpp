// ampx-train's own processes: this binary started again (processes.h).

#include "processes.h"

#include "run/preemption.h"

#include <ampx/dist.h>

#include <c10/util/Exception.h>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <system_error>
#include <vector>

extern char** environ;

namespace ampx::train {

namespace {

namespace fs = std::filesystem;

/// Starts this binary again with `argv` plus `extra`, and `env` added to
/// the environment; returns the child's pid.
pid_t spawn_self(int argc, char** argv, const std::vector<std::string>& extra,
                 const std::vector<std::string>& env = {}) {
  std::vector<char*> args(argv, argv + argc);
  for (const auto& e : extra) args.push_back(const_cast<char*>(e.c_str()));
  args.push_back(nullptr);
  std::vector<char*> envp;
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
  envp.push_back(nullptr);
  pid_t pid = 0;
  const int err = ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, args.data(), envp.data());
  TORCH_CHECK(err == 0, "ampx-train: cannot start a training process: ", std::strerror(err));
  return pid;
}

/// A wait status as a shell shows it: the exit code, or 128 + the signal.
int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

int wait_child(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    TORCH_CHECK(errno == EINTR, "ampx-train: waitpid failed: ", std::strerror(errno));
  }
  return exit_code(status);
}

}  // namespace

int run_child(int argc, char** argv, const std::vector<std::string>& extra) {
  const pid_t child = spawn_self(argc, argv, extra);
  forward_preemption_to(child);  // it stops, checkpoints and exits kExitPreempted
  return wait_child(child);
}

int run_ranks(int argc, char** argv, int nproc, const std::vector<std::string>& extra) {
  const std::string port = std::to_string(ampx::dist::free_loopback_port());
  std::string folder = (fs::temp_directory_path() / "ampx-train-ranks-XXXXXX").string();
  TORCH_CHECK(::mkdtemp(folder.data()) != nullptr,
              "ampx-train: cannot make a folder for the ranks' rendezvous file in ",
              fs::temp_directory_path().string(), ": ", std::strerror(errno));
  const std::string store_file = (fs::path(folder) / "store").string();
  std::vector<pid_t> pids;
  for (int r = 0; r < nproc; ++r) {
    pids.push_back(
        spawn_self(argc, argv, extra,
                   {"RANK=" + std::to_string(r), "LOCAL_RANK=" + std::to_string(r),
                    "WORLD_SIZE=" + std::to_string(nproc),
                    "LOCAL_WORLD_SIZE=" + std::to_string(nproc), "MASTER_ADDR=127.0.0.1",
                    "MASTER_PORT=" + port, std::string(kStoreFileEnv) + "=" + store_file}));
    forward_preemption_to(pids.back());
  }
  int result = 0;
  for (size_t done = 0; done < pids.size(); ++done) {
    int status = 0;
    const pid_t pid = ::wait(&status);
    if (pid < 0 && errno == EINTR) {  // a preemption signal, passed on to the ranks
      --done;
      continue;
    }
    if (pid < 0) break;
    const int code = exit_code(status);
    if (code == kExitPreempted && result == 0) result = code;  // the others stop too
    if (code != 0 && code != kExitPreempted && (result == 0 || result == kExitPreempted)) {
      result = code;
      const auto rank = std::find(pids.begin(), pids.end(), pid) - pids.begin();
      std::cout << std::flush;
      std::fprintf(stderr, "ampx-train: rank %lld ended with status %d; stopping the others\n",
                   static_cast<long long>(rank), code);
      // SIGTERM would ask them to finish their step, which waits for this rank.
      for (const pid_t other : pids) {
        if (other != pid) ::kill(other, SIGKILL);
      }
    }
  }
  std::error_code ignored;
  fs::remove_all(folder, ignored);
  return result;
}

}  // namespace ampx::train
