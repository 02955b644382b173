#pragma once

// Preemption: what Slurm and Kubernetes send before they kill a job (SIGTERM,
// or SIGUSR1 with `--signal`) asks ampx-train to stop cleanly. The training
// process finishes the step it is in, writes a checkpoint, and exits with
// kExitPreempted; `--resume` continues bit for bit. Processes that only
// start others (--compare, --nproc) pass the signal on to them.
//
//   install_preemption_handlers();           // once, early in main()
//   ... after each step:
//   if (preemption_signal() != 0) { save(...); return kExitPreempted; }
//
// Under --nproc and launchers the ranks agree on the step to stop at (the
// trainer all-reduces a stop flag with each step's loss): a signal that
// reaches one rank stops all of them after the same step.

#include <sys/types.h>

#include <string>

namespace ampx::train {

/// Exit status of a run stopped by SIGTERM or SIGUSR1 after writing its
/// checkpoint: EX_TEMPFAIL of <sysexits.h>, "try again later" (--resume).
inline constexpr int kExitPreempted = 75;

/// Catches SIGTERM and SIGUSR1 from now on (SA_RESTART: system calls that
/// they interrupt go on). The first one is recorded for preemption_signal()
/// and passed to every process registered with forward_preemption_to().
void install_preemption_handlers();

/// The preemption signal this process received (SIGTERM or SIGUSR1), 0 if none.
[[nodiscard]] int preemption_signal();

/// From now on a preemption signal this process receives (or received
/// already) is sent on to `child` as well. At most 256 children.
void forward_preemption_to(pid_t child);

/// "SIGTERM", "SIGUSR1", or "signal N".
std::string signal_name(int signal);

}  // namespace ampx::train
