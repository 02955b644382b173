#pragma once

// What the tracking allocator (memory.cpp) tells the origins' record
// (memory_origins.cpp): each block's origin id lives in the block's header,
// 0 for a block allocated while nothing was recorded.

#include <cstdint>

namespace ampx {
namespace detail {

/// Blocks the tracking allocator has handed out and not had back.
int64_t live_cpu_blocks();

/// Whether origins are being recorded now.
bool recording_memory_origins();

/// The origin id of a block of `size` bytes this thread allocates now. The
/// allocator has counted it: `allocated` bytes and `live_blocks` blocks are
/// live with it; where that is the most the record has seen, it keeps the
/// bytes of each origin as they are now, as the peak's.
uint32_t note_origin_allocation(int64_t size, int64_t allocated, int64_t live_blocks);

/// A block of origin `origin` (not 0) and `size` bytes is freed.
void note_origin_free(uint32_t origin, int64_t size);

/// reset_peak_cpu_memory(): the peak is what is live now.
void note_origin_peak_reset(int64_t allocated, int64_t live_blocks);

}  // namespace detail
}  // namespace ampx
