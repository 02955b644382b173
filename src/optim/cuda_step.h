#pragma once

// ampx::optim's fused CUDA step (cuda/fused_step.cu, compiled by nvcc where
// the LibTorch found has CUDA): multi-tensor kernels that update every dense
// CUDA param of a step in a few launches, with the arithmetic of
// kernels/optim_math.h (the CPU kernels' own). Nothing here reads a device
// value on the host: the found-inf flag and the gradient multiplier
// (1 / scale, times the clip coefficient) are read by the kernels, which
// also count the step on the device and skip it there.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <vector>

namespace ampx {
namespace optim {
namespace detail {
namespace cuda {

enum class Update : int32_t { kAdamW = 0, kSgd = 1, kLamb = 2 };

/// One parameter's operands and options: plain data, copied to the device
/// as it is (pointers into device memory).
struct TensorArgs {
  void* param = nullptr;        // fp32, bf16 or fp16, contiguous
  float* master = nullptr;      // fp32 master or null
  const void* grad = nullptr;   // the param's dtype, contiguous
  float* exp_avg = nullptr;     // fp32 first moment / momentum buffer, or null
  float* exp_avg_sq = nullptr;  // fp32 second moment, or null
  double* step = nullptr;       // float64 []: steps taken; counted by the step itself
  int64_t numel = 0;
  int64_t position = 0;     // over all groups: stochastic rounding's key
  int64_t first_chunk = 0;  // filled by fused_step
  int64_t chunks = 0;       // filled by fused_step
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  double momentum = 0, dampening = 0;
  int32_t nesterov = 0;
  int32_t stochastic_rounding = 0;  // bf16 params without master only
};
// No padding bytes: a step compares its operands with the last step's byte
// for byte (MetaCache), so every byte must be a member's.
static_assert(sizeof(TensorArgs) == 5 * sizeof(void*) + sizeof(double*) + 4 * sizeof(int64_t) +
                                        7 * sizeof(double) + 2 * sizeof(int32_t),
              "TensorArgs must have no padding");

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

/// One step of `update` for the params of `args`, all on the CUDA `device`.
/// `grad_mul`: float [] on the device or undefined (1); `found_inf`: float []
/// on the device or undefined (never skip). `dtypes`: each param's dtype.
void fused_step(Update update, const std::vector<TensorArgs>& args,
                const std::vector<c10::ScalarType>& dtypes, c10::Device device,
                const at::Tensor& grad_mul, const at::Tensor& found_inf, uint64_t seed,
                MetaCache& cache);

}  // namespace cuda
}  // namespace detail
}  // namespace optim
}  // namespace ampx
