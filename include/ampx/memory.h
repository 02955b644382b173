#pragma once

// Allocated tensor bytes on the CPU, counted by a tracking allocator that
// wraps LibTorch's own (the CUDA side has the caching allocator's stats).
// Peak training memory is measured with it, not estimated from RSS.
//
//   ampx::enable_cpu_memory_tracking();          // before the tensors to count
//   ampx::reset_peak_cpu_memory();
//   train_step();
//   auto peak = ampx::cpu_memory_stats().peak_allocated_bytes;

#include <cstdint>

namespace ampx {

struct MemoryStats {
  int64_t allocated_bytes = 0;       // live now
  int64_t peak_allocated_bytes = 0;  // most live at once since the last reset
  int64_t allocations = 0;           // allocations since tracking began
};

/// Installs the tracking allocator as LibTorch's CPU allocator (once; later
/// calls do nothing). Only tensors allocated after this are counted; earlier
/// ones are freed by their own allocator as before. Errors if another
/// allocator with a higher priority is installed.
void enable_cpu_memory_tracking();
bool cpu_memory_tracking_enabled();

/// Zeros when tracking is not enabled.
MemoryStats cpu_memory_stats();

/// Sets the peak to what is allocated now.
void reset_peak_cpu_memory();

}  // namespace ampx
