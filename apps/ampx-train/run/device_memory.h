#pragma once

// Peak allocated tensor bytes on the training device: ampx's tracking
// allocator on the CPU, the caching allocator's statistics on CUDA.

#include <c10/core/Device.h>

#include <cstdint>

namespace ampx::train {

/// Starts counting (CPU: installs the tracking allocator; call before the
/// data is loaded so that every training tensor is counted).
void enable_memory_tracking(const c10::Device& device);
int64_t allocated_bytes(const c10::Device& device);
int64_t peak_allocated_bytes(const c10::Device& device);
void reset_peak_memory(const c10::Device& device);
/// Hands the memory the caching allocator keeps for freed tensors back to
/// the device (CUDA's emptyCache), so that the processes a measuring parent
/// starts next find it free; nothing on the CPU.
void release_cached_memory(const c10::Device& device);

}  // namespace ampx::train
