#pragma once

// ampx-train's own processes: this binary started again, as one mode of a
// --compare run (in a process of its own) or as --nproc's ranks on loopback.
//
//   const int code = run_child(argc, argv, {"--only-mode", "O2"});  // its exit status
//   return run_ranks(argc, argv, config.nproc);                     // the first failure's

#include <string>
#include <vector>

namespace ampx::train {

/// The environment variable that hands --nproc's ranks their store file.
inline constexpr const char* kStoreFileEnv = "AMPX_TRAIN_STORE_FILE";

/// Runs this binary again with argv plus `extra`, passes preemption signals
/// on to it, and returns its exit status (128 + the signal that ended it).
int run_child(int argc, char** argv, const std::vector<std::string>& extra);

/// --nproc N: N copies of this run as ranks 0..N-1 (torchrun's variables on
/// loopback); they meet in a FileStore in a fresh folder of their own, so
/// that no rendezvous port listens (Gloo listens on 127.0.0.1). The first
/// to fail stops the others. A preemption signal goes to every rank; they
/// stop after the same step (kExitPreempted). `extra`: arguments added to
/// every rank's.
int run_ranks(int argc, char** argv, int nproc, const std::vector<std::string>& extra = {});

}  // namespace ampx::train
