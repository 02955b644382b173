#pragma once

// The fused step on CUDA (cuda_step.cu, compiled by nvcc where the LibTorch
// found has CUDA): multi-tensor kernels that update every dense CUDA param
// of a step in a few launches, reading the same FusedParam and running the
// same arithmetic as the CPU spans (fused_step.h). Nothing here reads a
// device value on the host: the found-inf flag and the gradient multiplier
// (1 / scale, times the clip coefficient) are read by the kernels, which
// also count the step on the device and skip it there.

#include "fused_step.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <vector>

namespace ampx {
namespace optim {
namespace detail {
namespace cuda {

/// A param as the CUDA step reads it: its FusedParam (pointers into device
/// memory), its step count on the device, and its chunks. Copied to the
/// device as it is.
struct DeviceParam {
  FusedParam p;
  double* step = nullptr;   // float64 []: steps taken; counted by the step itself
  int64_t first_chunk = 0;  // filled by fused_step
  int64_t chunks = 0;       // filled by fused_step
};
// No padding bytes: a step compares its operands with the last step's byte
// for byte (MetaCache), so every byte must be a member's.
static_assert(sizeof(DeviceParam) == sizeof(FusedParam) + sizeof(double*) + 2 * sizeof(int64_t),
              "DeviceParam must have no padding");

/// What an optimizer keeps between steps, per CUDA device: the operands as
/// last uploaded. A step whose operands are those of the last one (the same
/// tensors, options and learning rate) uploads nothing.
struct MetaCache {
  struct Entry {
    std::vector<uint8_t> bytes;
    at::Tensor host;  // pinned, kept: a captured CUDA graph's copy reads it on replay
    at::Tensor device;
  };
  std::map<int, Entry> by_device;
};

/// Whether this build has the kernels.
bool built();

/// One step for `params`, all of one update and on the CUDA `device`.
/// `grad_mul`: float [] on the device or undefined (1); `found_inf`: float []
/// on the device or undefined (never skip).
void fused_step(const std::vector<DeviceParam>& params, c10::Device device,
                const at::Tensor& grad_mul, const at::Tensor& found_inf, uint64_t seed,
                MetaCache& cache);

}  // namespace cuda
}  // namespace detail
}  // namespace optim
}  // namespace ampx
