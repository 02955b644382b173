#pragma once

/// \file
/// Data-parallel training on PyTorch's own c10d process groups (Gloo for CPU
/// tensors, NCCL for CUDA tensors in CUDA builds), launched by torchrun, Open
/// MPI or Slurm, or by hand:
///
/// ```
///   auto pg = ampx::dist::init_process_group();          // RANK, WORLD_SIZE, MASTER_ADDR, ...
///   ampx::dist::DistributedDataParallel ddp(model, pg);  // rank 0's weights everywhere
///   for (...) {
///     opt.zero_grad();
///     auto loss = loss_fn(model->forward(x_shard), y_shard);
///     scaler.scale(loss).backward();                     // buckets all-reduce during backward
///     ddp.synchronize();                                 // wait, average into .grad
///     scaler.step(opt);                                  // same grads, same skip on every rank
///     scaler.update();
///   }
/// ```
///
/// Gradients are all-reduced in buckets (default 25 MiB) launched from
/// gradient hooks as soon as every gradient of a bucket is ready, so the
/// communication overlaps the rest of backward. Because every rank steps
/// with the same averaged gradients, an inf/NaN on any rank reaches all of
/// them and GradScaler skips and backs off identically everywhere.

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace at {
class Tensor;
}  // namespace at
namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace ampx {
class GradScaler;
namespace detail {
struct ProcessGroupAccess;
}  // namespace detail

/// Data-parallel training on c10d process groups: launch environments,
/// ProcessGroup, DistributedDataParallel, and ZeRO stage 1 (ampx/zero.h).
namespace dist {

/// Where this process sits, as a launcher described it.
struct LaunchEnv {
  int64_t rank = 0;        ///< this process's index among all ranks
  int64_t world_size = 1;  ///< ranks in the run
  int64_t local_rank = 0;  ///< this process's index among the ranks on this host
  /// Processes of this run on this host: torchrun's LOCAL_WORLD_SIZE, Open
  /// MPI's OMPI_COMM_WORLD_LOCAL_SIZE, Slurm's SLURM_STEP_TASKS_PER_NODE (or
  /// SLURM_TASKS_PER_NODE, e.g. "2(x3),1") at SLURM_NODEID; 1 when unset.
  int64_t local_world_size = 1;
  /// This host's index among the hosts: torchrun's GROUP_RANK (or NODE_RANK),
  /// Slurm's SLURM_NODEID; -1 when the launcher does not say.
  int64_t node_rank = -1;
  std::string master_addr;  ///< MASTER_ADDR: the host of rank 0's rendezvous store
  int64_t master_port = 0;  ///< MASTER_PORT: the store's TCP port
  std::string launcher;     ///< "torchrun", "Open MPI", "Slurm"
  /// torchrun's agent already serves the TCPStore at MASTER_PORT
  /// (TORCHELASTIC_USE_AGENT_STORE=True): every rank, rank 0 included, joins
  /// it as a client, under "/worker/attempt_<TORCHELASTIC_RESTART_COUNT>/",
  /// as PyTorch's own init_process_group does.
  bool agent_store = false;
  /// TORCHELASTIC_RESTART_COUNT with agent_store (the attempt number), else 0.
  int64_t restart_count = 0;
};

/// Reads torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
/// else Open MPI's OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK; else Slurm's
/// SLURM_PROCID/NTASKS/LOCALID (MASTER_ADDR and MASTER_PORT are needed with
/// the latter two). Errors name every variable that is missing or malformed.
LaunchEnv launch_env_from_environment();

/// Whether a launcher started this process as one rank of a run, by the
/// rules launch_env_from_environment() reads: torchrun's RANK or WORLD_SIZE
/// set (a partial set is then reported by launch_env_from_environment), or
/// Open MPI's or Slurm's task count above 1 (a lone `mpirun -n 1` or batch
/// job is not a data-parallel run). A program that trains alone otherwise
/// asks this first.
bool launched_as_rank();

/// init_process_group()'s settings, set by chained calls:
/// `InitOptions().timeout(std::chrono::seconds(60)).nccl(false)`.
struct InitOptions {
  /// How long rendezvous and each collective may take before they fail.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::seconds(300);
  /// Network interfaces Gloo binds to, comma separated ("eth0" or
  /// "eth0,eth1": one Gloo device each, used in turn), as PyTorch's
  /// GLOO_SOCKET_IFNAME, which applies when this and hostname() are empty.
  TORCH_ARG(std::string, interfaces) = "";
  /// Address (or name) Gloo binds to, when interfaces() is empty. With
  /// neither, nor GLOO_SOCKET_IFNAME: the source address of this host's
  /// route to MASTER_ADDR (never a guess from the hostname), so a rank on
  /// another host binds to the interface that reaches the first one.
  TORCH_ARG(std::string, hostname) = "";
  /// Also make an NCCL group, which then carries every collective on CUDA
  /// tensors (PyTorch 2's default "cpu:gloo,cuda:nccl"), when this ampx was
  /// built with NCCL (is_nccl_available()) and a CUDA device is visible.
  /// Each rank uses the CUDA device of the tensors it passes: set it from
  /// LaunchEnv::local_rank. False: Gloo for all tensors.
  TORCH_ARG(bool, nccl) = true;
  /// Rendezvous through a c10d FileStore at this path instead of a TCPStore
  /// at MASTER_ADDR:MASTER_PORT (PyTorch's init_method="file://..."): ranks
  /// on one machine then listen on no store port at all (Gloo still uses
  /// TCP on the address chosen as above). The file must not exist before
  /// the run; the last rank to end removes it. Empty: the TCPStore.
  TORCH_ARG(std::string, store_file) = "";
};

/// A c10d process group: Gloo, plus NCCL for CUDA tensors where there is
/// one (see InitOptions::nccl). Every collective goes to the backend of its
/// tensor's device. Copies share one group.
class ProcessGroup {
 public:
  /// This process's rank in the group.
  int64_t rank() const;
  /// Ranks in the group.
  int64_t world_size() const;
  /// InitOptions::timeout: how long a collective may take before it fails.
  std::chrono::milliseconds timeout() const;
  /// Whether CUDA tensors go through NCCL ("gloo" or "gloo+nccl" in backends()).
  bool has_nccl() const;
  /// "gloo", or "gloo+nccl" with NCCL.
  std::string backends() const;
  /// The address Gloo serves this rank on and how it was chosen:
  /// "10.0.0.2 (the route to MASTER_ADDR 10.0.0.1)", "10.0.0.1 (GLOO_SOCKET_IFNAME=eth0)".
  std::string gloo_endpoint() const;
  /// Sums `tensor` in place over all ranks and waits.
  void all_reduce_sum(at::Tensor& tensor) const;
  /// Takes the element-wise maximum in place over all ranks and waits.
  void all_reduce_max(at::Tensor& tensor) const;
  /// Sums `input` (1-D, world_size * n elements) over all ranks and writes
  /// this rank's n-element chunk of the sum into `output` (1-D, n), and waits.
  /// Where Gloo has no reduce-scatter (LibTorch 1.13), an all-reduce of
  /// `input` (which it then overwrites) and a copy of the chunk.
  void reduce_scatter_sum(at::Tensor& output, at::Tensor& input) const;
  /// Concatenates every rank's `input` (1-D, n) into `output` (1-D,
  /// world_size * n) in rank order, and waits. bfloat16 travels bitwise.
  void all_gather(at::Tensor& output, const at::Tensor& input) const;
  /// Every rank's `bytes`, in rank order (PyTorch's all_gather_object, for
  /// a string): two all-gathers, of the lengths and of the bytes padded to
  /// the longest. On rank 1 of 2: all_gather_bytes("b");  // {"a", "b"}
  std::vector<std::string> all_gather_bytes(const std::string& bytes) const;
  /// Copies rank `root`'s `tensor` into every rank's, in place, and waits.
  void broadcast(at::Tensor& tensor, int64_t root = 0) const;
  /// Returns when every rank has called it.
  void barrier() const;

 private:
  // ampx's dist sources reach the c10d backends through ProcessGroupAccess
  // (src/dist/process_group_impl.h); users only see the methods above.
  friend struct ampx::detail::ProcessGroupAccess;
  struct Impl;
  explicit ProcessGroup(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

/// Makes every rank's `scaler` agree on overflows: each found-inf check is
/// all-reduced (MAX) over `group`, so when any rank's gradients hold an
/// inf/NaN all ranks skip the step and back off the scale identically.
/// Needed whenever ranks step on gradients they have not all-reduced
/// themselves (ZeroRedundancyOptimizer, ampx/zero.h); harmless with
/// DistributedDataParallel, whose averaged gradients agree already.
void synchronize_found_inf(GradScaler& scaler, ProcessGroup group);

/// Rendezvous through c10d's TCPStore at env.master_addr:master_port (rank 0
/// serves it, or torchrun's agent: on that address alone when it is a
/// numeric loopback address and LibTorch allows it (2.3+), else on every
/// interface; a port in use is an error naming it), or through
/// InitOptions::store_file, and a Gloo process
/// group over it (and an NCCL one, see InitOptions::nccl). Errors name what
/// is missing and, on timeout, the ranks that did not arrive; ranks started
/// with different world sizes fail at once, naming theirs. Before Gloo
/// connects, the ranks exchange their Gloo addresses: a rank bound to
/// loopback that ranks on other hosts would have to reach is an error
/// naming GLOO_SOCKET_IFNAME. A collective that fails (a rank died, a host
/// fell off the network, a rank was stopped) fails within the timeout,
/// naming the ranks that no longer answer, that are stopped, or that have
/// not reached the collective, and their addresses. SIGPIPE left at its
/// default disposition is set to ignored, as Python sets it for
/// torch.distributed: Gloo's writes to a lost peer raise it, and it would end
/// the process without a word (a handler, or SIG_IGN, the program set stays).
ProcessGroup init_process_group(const LaunchEnv& env, const InitOptions& options = {});
/// The same, from launch_env_from_environment().
ProcessGroup init_process_group(const InitOptions& options = {});

/// Whether this build of ampx has c10d with Gloo.
bool is_available();
/// Whether this build of ampx has c10d's NCCL process group (LibTorch built
/// with CUDA and NCCL, e.g. PyTorch's pip wheels; never Debian's).
bool is_nccl_available();

/// A TCP port on 127.0.0.1 that nothing listens on now: MASTER_PORT for
/// ranks started on this machine (another process could still take it
/// before rank 0's store binds it). Throws if the system has none.
int free_loopback_port();

/// DistributedDataParallel's settings, PyTorch's defaults, set by chained
/// calls: `DistributedDataParallelOptions().communication_dtype(torch::kBFloat16)`.
struct DistributedDataParallelOptions {
  /// Most bytes of gradients per all-reduce (PyTorch's bucket_cap_mb).
  TORCH_ARG(int64_t, bucket_cap_bytes) = 25 * 1024 * 1024;
  /// Most bytes of the first bucket (the last layers' gradients), smaller so
  /// that communication starts early in backward (PyTorch uses 1 MiB too).
  TORCH_ARG(int64_t, first_bucket_cap_bytes) = 1024 * 1024;
  /// Type the gradients travel in: nullopt keeps each gradient's own type
  /// (a 16-bit one goes as float32 where this Gloo cannot sum its type:
  /// bfloat16 on LibTorch 1.13, float16 on Debian's 2.14); kBFloat16 or kHalf
  /// halve the bytes of fp32 gradients (summed in that type by Gloo, then
  /// averaged back into the gradient's type). A float16 sum is divided by
  /// the world size in two parts, before and after it (FSDP's factors), so
  /// that it neither overflows nor underflows; other types after it.
  TORCH_ARG(c10::optional<c10::ScalarType>, communication_dtype) = c10::nullopt;
  /// Parameters that get no gradient in an iteration count as zero instead
  /// of being an error (PyTorch's find_unused_parameters).
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Broadcast rank 0's parameters and buffers at construction.
  TORCH_ARG(bool, broadcast_parameters) = true;
};

/// PyTorch's DistributedDataParallel for a torch::nn::Module: the module is
/// used as is (call its forward), this object owns the gradient hooks.
/// Construction is collective: the ranks first compare their parameters and
/// buffers (names, dtypes, shapes) and options, and every rank throws,
/// naming what differs on which ranks, when one was given another model.
class DistributedDataParallel {
 public:
  /// Wraps `module` on every rank of `group` (collective: see above) and
  /// installs the gradient hooks that fill and launch the buckets.
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, ProcessGroup group,
                          DistributedDataParallelOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// After backward: launches buckets still waiting, waits for all, and
  /// writes the averaged gradients into each parameter's .grad.
  void synchronize();

  /// While a NoSyncGuard lives, backward only accumulates into .grad (no
  /// communication); the next backward outside it reduces the accumulated
  /// gradients (PyTorch's no_sync for gradient accumulation).
  class NoSyncGuard {
   public:
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    friend class DistributedDataParallel;
    explicit NoSyncGuard(DistributedDataParallel& ddp);
    DistributedDataParallel& ddp_;
  };
  /// `auto guard = ddp.no_sync();`: backward without communication while
  /// `guard` lives (see NoSyncGuard).
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  /// Bytes all-reduced so far (what the communication dtype saves).
  int64_t bytes_communicated() const;
  /// Buckets: each bucket's parameter indices (into module->parameters()).
  std::vector<std::vector<int64_t>> bucket_layout() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dist
}  // namespace ampx
