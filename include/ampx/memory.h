#pragma once

/// \file
/// Allocated tensor bytes on the CPU, counted by a tracking allocator that
/// wraps LibTorch's own (the CUDA side has the caching allocator's stats).
/// Peak training memory is measured with it, not estimated from RSS.
///
/// ```
///   ampx::enable_cpu_memory_tracking();          // before the tensors to count
///   ampx::reset_peak_cpu_memory();
///   train_step();
///   auto peak = ampx::cpu_memory_stats().peak_allocated_bytes;
/// ```

#include <cstdint>
#include <string>
#include <vector>

namespace ampx {

/// Bytes of CPU tensors counted by the tracking allocator.
struct MemoryStats {
  int64_t allocated_bytes = 0;       ///< live now
  int64_t peak_allocated_bytes = 0;  ///< most live at once since the last reset
  int64_t allocations = 0;           ///< allocations since tracking began
};

/// Installs the tracking allocator as LibTorch's CPU allocator (once; later
/// calls do nothing). Only tensors allocated after this are counted; earlier
/// ones are freed by their own allocator as before. Errors if another
/// allocator with a higher priority is installed.
void enable_cpu_memory_tracking();
/// Whether enable_cpu_memory_tracking() has installed the tracking allocator.
bool cpu_memory_tracking_enabled();

/// Zeros when tracking is not enabled.
MemoryStats cpu_memory_stats();

/// Sets the peak to what is allocated now.
void reset_peak_cpu_memory();

/// Where the bytes live at the peak came from: the phase they were allocated
/// in (CpuMemoryPhaseGuard's name) and the outermost op or autograd node that
/// allocated them. A saved activation is made in phase "forward" by its op
/// (`aten::gelu`), a gradient in "backward" by its node (`MmBackward0`), an
/// optimizer's state in its step.
struct MemoryOrigin {
  std::string phase;   ///< "" outside any CpuMemoryPhaseGuard
  std::string op;      ///< e.g. "aten::addmm", "MmBackward0"; "" outside any op
  int64_t bytes = 0;   ///< of its blocks live at the peak
  int64_t blocks = 0;  ///< how many of them
};

/// The phase of MemoryOrigin for the blocks allocated while nothing was
/// recorded (before start_cpu_memory_origins(), or in an earlier recording).
inline constexpr char kNotRecordedPhase[] = "(not recorded)";

/// Starts recording the origin of each block the tracking allocator hands
/// out from now on (it enables tracking): LibTorch's op callbacks
/// (RecordFunction) name the outermost op of each thread. Slower allocation
/// and a callback per op: a diagnostic, not for timed runs. One recording
/// for the process: a second start begins a new one, and any stop ends it.
void start_cpu_memory_origins();
/// Stops recording origins; peak_cpu_memory_origins() still reads the
/// recorded peak, until the next start.
void stop_cpu_memory_origins();

/// The bytes live at the peak, by origin, most bytes first: the peak that
/// recorded allocations reached since start_cpu_memory_origins() or the last
/// reset_peak_cpu_memory() while recording. Blocks allocated while nothing
/// was recorded come as one origin, kNotRecordedPhase. The bytes sum to that
/// peak when one thread allocates; work that LibTorch spreads over its
/// intra-op threads allocates there under phase "", and a peak reached by
/// several threads at once is kept at one of their allocations.
///
/// ```
///   ampx::start_cpu_memory_origins();
///   ampx::reset_peak_cpu_memory();
///   { ampx::CpuMemoryPhaseGuard phase("forward"); loss = model(x); }
///   { ampx::CpuMemoryPhaseGuard phase("backward"); loss.backward(); }
///   ampx::peak_cpu_memory_origins()[0];  // {"forward", "aten::addmm", 58720256, 8}
/// ```
[[nodiscard]] std::vector<MemoryOrigin> peak_cpu_memory_origins();

/// Names the phase of this thread's allocations (MemoryOrigin::phase) while
/// it lives; the phase before comes back at its end.
class CpuMemoryPhaseGuard {
 public:
  /// This thread's allocations count under `phase` from now on.
  explicit CpuMemoryPhaseGuard(const std::string& phase);
  /// They count under the phase before again.
  ~CpuMemoryPhaseGuard();
  CpuMemoryPhaseGuard(const CpuMemoryPhaseGuard&) = delete;
  CpuMemoryPhaseGuard& operator=(const CpuMemoryPhaseGuard&) = delete;

 private:
  uint32_t previous_;
};

/// What keep_freed_cpu_memory() did.
struct MallocRetention {
  bool applied = false;        ///< false: nothing changed, `reason` says why
  int64_t mmap_threshold = 0;  ///< bytes: blocks above it are mapped and unmapped one by one
  int64_t trim_threshold = 0;  ///< bytes free at a heap's top before they go back to the OS
  std::string reason;          ///< why nothing changed; empty when applied
};

/// Makes glibc's malloc keep freed memory for the next step instead of
/// handing it back to the kernel. A training step frees and allocates the
/// same activations every step; by default glibc returns the heap's free top
/// whenever it exceeds a threshold that adapts to the largest block freed so
/// far (twice its size), and the next step takes every page back with a page
/// fault and a zero-fill: on the gpt of ampx-train, 29,000 faults and about
/// 40 ms of a 500 ms fp32 step (docs/performance-notes.md). This fixes the mmap threshold
/// at 32 MiB (glibc's largest on 64-bit: smaller blocks come from the heaps)
/// and the trim threshold at `trim_threshold` bytes. A process-wide setting:
/// call it once, at start, in a program that trains. Does nothing where the C
/// library is not glibc, or where GLIBC_TUNABLES already sets either threshold
/// (the user's choice wins).
///
/// ```
///   auto r = ampx::keep_freed_cpu_memory();  // r.applied == true on glibc
/// ```
MallocRetention keep_freed_cpu_memory(int64_t trim_threshold = int64_t{1} << 30);

}  // namespace ampx
