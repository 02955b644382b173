#include "device_memory.h"

#include <ampx/memory.h>

#include <c10/util/Exception.h>

#include <vector>

#if defined(AMPX_TRAIN_WITH_CUDA)
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace ampx::train {
namespace {

#if defined(AMPX_TRAIN_WITH_CUDA)
// The statistics' types moved from c10::cuda::CUDACachingAllocator to
// c10::CachingDeviceAllocator in 2.6 (DeviceStats stays visible in both):
// named through getDeviceStats' result. StatType::AGGREGATE is index 0 in
// every version.
using DeviceStats = decltype(c10::cuda::CUDACachingAllocator::getDeviceStats(0));
constexpr size_t kAggregate = 0;

// The caching allocator's index of `device`, once the allocator is set up:
// PyTorch 2.8+ sets it up at the first allocation, and until then its
// statistics calls fail with "Invalid device argument" (a run resets the peak
// before its model is on the device). One element allocated and freed sets it
// up; the block stays cached, so nothing counts as allocated.
c10::DeviceIndex cuda_allocator_index(const c10::Device& device) {
  const c10::Device cuda(c10::kCUDA, device.index() < 0 ? 0 : device.index());
  static thread_local std::vector<bool> ready;
  const auto i = static_cast<size_t>(cuda.index());
  if (ready.size() <= i) ready.resize(i + 1, false);
  if (!ready[i]) {
    (void)at::empty({1}, at::TensorOptions().dtype(at::kByte).device(cuda));
    ready[i] = true;
  }
  return cuda.index();
}

const auto& cuda_allocated(const c10::Device& device) {
  static thread_local DeviceStats stats;
  stats = c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_allocator_index(device));
  return stats.allocated_bytes[kAggregate];
}
#endif

void require_cuda_build(const c10::Device& device) {
  TORCH_CHECK(device.is_cpu(), "ampx-train: memory statistics for ", device,
              " need a build against a CUDA LibTorch");
}

}  // namespace

void enable_memory_tracking(const c10::Device& device) {
  if (device.is_cpu()) ampx::enable_cpu_memory_tracking();
}

int64_t allocated_bytes(const c10::Device& device) {
#if defined(AMPX_TRAIN_WITH_CUDA)
  if (device.is_cuda()) return cuda_allocated(device).current;
#endif
  require_cuda_build(device);
  return ampx::cpu_memory_stats().allocated_bytes;
}

int64_t peak_allocated_bytes(const c10::Device& device) {
#if defined(AMPX_TRAIN_WITH_CUDA)
  if (device.is_cuda()) return cuda_allocated(device).peak;
#endif
  require_cuda_build(device);
  return ampx::cpu_memory_stats().peak_allocated_bytes;
}

void reset_peak_memory(const c10::Device& device) {
#if defined(AMPX_TRAIN_WITH_CUDA)
  if (device.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(cuda_allocator_index(device));
    return;
  }
#endif
  require_cuda_build(device);
  ampx::reset_peak_cpu_memory();
}

void release_cached_memory(const c10::Device& device) {
#if defined(AMPX_TRAIN_WITH_CUDA)
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  (void)device;
}

}  // namespace ampx::train
