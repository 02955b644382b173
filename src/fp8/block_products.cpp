// What multiplies block-scaled tensors (ampx/fp8/block.h): block_scaled_mm
// and its one alpha, and the 16-point Hadamard transform that NVFP4's
// weight-gradient product applies to both operands first.

#include "ampx/fp8/block.h"

#include "block_internal.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <bit>
#include <mutex>
#include <utility>
#include <vector>

namespace ampx {
namespace fp8 {
namespace {

// H = S H16 / 4, float32 [16, 16] on the CPU, built once: TE's sign vector
// S (get_wgrad_sign_vector, torchao's DEFAULT_SIGN_VECTOR) times the
// Sylvester matrix H16[i][j] = (-1)^popcount(i & j). A plain tensor even
// when first asked for under InferenceMode, so that autograd may save it.
const at::Tensor& cpu_hadamard() {
  static const at::Tensor* h = [] {
    static const float kSigns[16] = {1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1};
    c10::InferenceMode normal_tensors(false);
    auto* m = new at::Tensor(at::empty({16, 16}, at::kFloat));  // kept for the process
    auto a = m->accessor<float, 2>();
    for (int i = 0; i < 16; ++i) {
      for (int j = 0; j < 16; ++j) {
        a[i][j] = kSigns[i] * (std::popcount(static_cast<unsigned>(i & j)) % 2 ? -0.25f : 0.25f);
      }
    }
    return m;
  }();
  return *h;
}

// H on `device`: the CPU's, copied to each other device once.
at::Tensor hadamard_on(c10::Device device) {
  if (device.is_cpu()) return cpu_hadamard();
  static std::mutex mutex;
  // Kept for the process: a device tensor must not outlive its runtime at exit.
  static auto* copies = new std::vector<std::pair<c10::Device, at::Tensor>>();
  const std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [d, m] : *copies) {
    if (d == device) return m;
  }
  c10::InferenceMode normal_tensors(false);
  copies->emplace_back(device, cpu_hadamard().to(device));
  return copies->back().second;
}

}  // namespace

at::Tensor block_scaled_mm(const BlockTensor& a, const BlockTensor& b) {
  TORCH_CHECK_VALUE(a.codes.dim() == 2 && b.codes.dim() == 2 && a.codes.size(1) == b.codes.size(1),
                    "ampx::fp8::block_scaled_mm: a [M, K] and b [N, K], got ", a.codes.sizes(),
                    " and ", b.codes.sizes());
  at::Tensor y = at::mm(a.block_values(), b.block_values().t());
  const float alpha = detail::product_scale(a, b);
  if (alpha != 1.0f) y.mul_(alpha);
  return y;
}

float detail::product_scale(const BlockTensor& a, const BlockTensor& b) {
  if (a.format.rule() == ScaleRule::kNvfp4 && b.format.rule() == ScaleRule::kNvfp4) {
    // TE's alpha: amax_A * amax_B / (6 * 6 * 448 * 448), in float32.
    return a.global_amax * b.global_amax * (1.0f / (6.0f * 6.0f * 448.0f * 448.0f));
  }
  return a.tensor_scale() * b.tensor_scale();
}

at::Tensor hadamard16(const at::Tensor& x, bool inverse, int64_t dim) {
  const bool columns = dim == 0;
  TORCH_CHECK_VALUE(x.defined() && (dim == -1 || (columns && x.dim() == 2)),
                    "ampx::fp8::hadamard16: dim must be -1, or 0 of a 2-D tensor, got ", dim,
                    " for ", x.defined() ? x.sizes() : at::IntArrayRef{});
  const int64_t along = columns ? 0 : x.dim() - 1;
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(along) % 16 == 0, "ampx::fp8::hadamard16: dimension ",
                    along, " must be a multiple of 16, got ", x.sizes());
  const at::Tensor h = hadamard_on(x.device());
  const at::Tensor m = inverse ? h.t() : h;
  if (columns) {
    // Each column tile c (16 rows) as a row vector: (c^T m)^T = m^T c.
    const at::Tensor tiles = x.to(at::kFloat).reshape({x.size(0) / 16, 16, x.size(1)});
    return at::matmul(m.t(), tiles).reshape(x.sizes());
  }
  const at::Tensor tiles = x.to(at::kFloat).reshape({-1, 16});
  return at::mm(tiles, m).view(x.sizes());
}

}  // namespace fp8
}  // namespace ampx
