// The tracking CPU allocator. Each block carries its size (and its origin's
// id, memory_origins.h) in a 64-byte header in front of the data (so
// alignment stays LibTorch's 64 bytes and the DataPtr stays "simple": data ==
// context), and is freed through the wrapped allocator's raw deleter.
// Counters are lock-free atomics.

#include "ampx/memory.h"

#include "ampx/detail/compat.h"

#include "memory_origins.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>

// c10::Allocator::allocate lost its const and gained a pure copy_data() in
// LibTorch 2.3 (`override` below stops the build if the guess is wrong).
#if AMPX_TORCH_AT_LEAST(2, 3)
#define AMPX_ALLOCATOR_CONST
#define AMPX_ALLOCATOR_HAS_COPY_DATA 1
#else
#define AMPX_ALLOCATOR_CONST const
#define AMPX_ALLOCATOR_HAS_COPY_DATA 0
#endif

namespace ampx {
namespace {

constexpr size_t kHeader = 64;
constexpr size_t kOriginAt = 8;  // the header: int64 size, then uint32 origin

std::atomic<int64_t> g_allocated{0};
std::atomic<int64_t> g_live_blocks{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_count{0};
c10::Allocator* g_wrapped = nullptr;
c10::DeleterFnPtr g_wrapped_free = nullptr;

void tracked_free(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  int64_t size;
  uint32_t origin;
  std::memcpy(&size, base, sizeof(size));
  std::memcpy(&origin, base + kOriginAt, sizeof(origin));
  if (origin != 0) detail::note_origin_free(origin, size);
  g_allocated.fetch_sub(size, std::memory_order_relaxed);
  g_live_blocks.fetch_sub(1, std::memory_order_relaxed);
  g_wrapped_free(base);
}

struct TrackingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) AMPX_ALLOCATOR_CONST override {
    void* base = g_wrapped->raw_allocate(n + kHeader);
    const auto size = static_cast<int64_t>(n);
    std::memcpy(base, &size, sizeof(size));
    const int64_t now = g_allocated.fetch_add(size, std::memory_order_relaxed) + size;
    const int64_t blocks = g_live_blocks.fetch_add(1, std::memory_order_relaxed) + 1;
    int64_t peak = g_peak.load(std::memory_order_relaxed);
    while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    g_count.fetch_add(1, std::memory_order_relaxed);
    const uint32_t origin =
        detail::recording_memory_origins() ? detail::note_origin_allocation(size, now, blocks) : 0;
    std::memcpy(static_cast<char*>(base) + kOriginAt, &origin, sizeof(origin));
    void* data = static_cast<char*>(base) + kHeader;
    return {data, data, &tracked_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &tracked_free; }
#if AMPX_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
#endif
};

std::once_flag g_once;
TrackingAllocator g_allocator;

}  // namespace

void enable_cpu_memory_tracking() {
  std::call_once(g_once, [] {
    g_wrapped = c10::GetCPUAllocator();
    g_wrapped_free = g_wrapped->raw_deleter();
    TORCH_CHECK(g_wrapped_free != nullptr,
                "enable_cpu_memory_tracking: the installed CPU allocator has no raw deleter, "
                "so it cannot be wrapped");
    c10::SetCPUAllocator(&g_allocator, /*priority=*/100);
  });
  TORCH_CHECK(c10::GetCPUAllocator() == &g_allocator,
              "enable_cpu_memory_tracking: another CPU allocator with a higher priority is "
              "installed; ampx's tracking allocator is not in use");
}

bool cpu_memory_tracking_enabled() { return c10::GetCPUAllocator() == &g_allocator; }

MemoryStats cpu_memory_stats() {
  MemoryStats s;
  s.allocated_bytes = g_allocated.load();
  s.peak_allocated_bytes = g_peak.load();
  s.allocations = g_count.load();
  return s;
}

void reset_peak_cpu_memory() {
  const int64_t now = g_allocated.load();  // one reading for both peaks
  g_peak.store(now);
  detail::note_origin_peak_reset(now, g_live_blocks.load());
}

namespace detail {

int64_t live_cpu_blocks() {
  return g_live_blocks.load();
}

}  // namespace detail

MallocRetention keep_freed_cpu_memory(int64_t trim_threshold) {
  // glibc refuses mmap thresholds above HEAP_MAX_SIZE / 2: 32 MiB on 64-bit.
  constexpr int64_t kMmapThreshold = int64_t{32} << 20;
  TORCH_CHECK(trim_threshold >= 0 && trim_threshold <= INT32_MAX,
              "keep_freed_cpu_memory: trim_threshold must be in [0, 2147483647] bytes (mallopt "
              "takes an int), got ",
              trim_threshold);
  MallocRetention r;
#if defined(__GLIBC__)
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables != nullptr && (std::strstr(tunables, "glibc.malloc.mmap_threshold") != nullptr ||
                              std::strstr(tunables, "glibc.malloc.trim_threshold") != nullptr)) {
    r.reason = std::string("GLIBC_TUNABLES sets malloc's thresholds already: ") + tunables;
    return r;
  }
  // Setting either threshold also turns off glibc's dynamic adjustment of both.
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMmapThreshold)) != 1 ||
      mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim_threshold)) != 1) {
    r.reason = "mallopt refused M_MMAP_THRESHOLD or M_TRIM_THRESHOLD";
    return r;
  }
  r.applied = true;
  r.mmap_threshold = kMmapThreshold;
  r.trim_threshold = trim_threshold;
#else
  r.reason = "the C library is not glibc";
#endif
  return r;
}

}  // namespace ampx
