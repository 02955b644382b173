#include "device_memory.h"

#include <ampx/memory.h>

#include <c10/util/Exception.h>

#if defined(AMPX_TRAIN_WITH_CUDA)
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

const auto& cuda_allocated(const c10::Device& device) {
  static thread_local DeviceStats stats;
  stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
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
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
    return;
  }
#endif
  require_cuda_build(device);
  ampx::reset_peak_cpu_memory();
}

}  // namespace ampx::train
