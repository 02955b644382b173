#include "preemption.h"

#include <c10/util/Exception.h>

#include <signal.h>

#include <atomic>
#include <cerrno>
#include <cstring>

namespace ampx::train {
namespace {

// Written by the signal handler: lock-free atomics only.
std::atomic<int> received{0};
constexpr int kMaxChildren = 256;
pid_t children[kMaxChildren];
std::atomic<int> child_count{0};

static_assert(std::atomic<int>::is_always_lock_free, "signal handlers need lock-free atomics");

void on_signal(int signal) {
  const int saved_errno = errno;  // kill() may set it under the interrupted code
  int expected = 0;
  received.compare_exchange_strong(expected, signal);
  const int n = child_count.load();
  for (int i = 0; i < n; ++i) ::kill(children[i], signal);
  errno = saved_errno;
}

}  // namespace

void install_preemption_handlers() {
  struct sigaction action {};
  action.sa_handler = on_signal;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  for (const int signal : {SIGTERM, SIGUSR1}) {
    TORCH_CHECK(::sigaction(signal, &action, nullptr) == 0, "ampx-train: cannot catch ",
                signal_name(signal), ": ", std::strerror(errno));
  }
}

int preemption_signal() {
  return received.load();
}

void forward_preemption_to(pid_t child) {
  const int n = child_count.load();
  TORCH_CHECK(n < kMaxChildren, "ampx-train: more than ", kMaxChildren, " child processes");
  children[n] = child;
  child_count.store(n + 1);  // the handler sees the pid before the count
  // A signal that came before the child existed reaches it too.
  if (const int signal = received.load(); signal != 0) ::kill(child, signal);
}

std::string signal_name(int signal) {
  switch (signal) {
    case SIGTERM:
      return "SIGTERM";
    case SIGUSR1:
      return "SIGUSR1";
    default:
      return "signal " + std::to_string(signal);
  }
}

}  // namespace ampx::train
