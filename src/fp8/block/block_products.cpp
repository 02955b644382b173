// What multiplies block-scaled tensors (ampx/fp8/block.h): block_scaled_mm
// and its one alpha, and the 16-point Hadamard transform that NVFP4's
// weight-gradient product applies to both operands first (block_math.h's
// butterflies on the CPU and in the CUDA kernel: the same float32 sums).

#include "ampx/fp8/block.h"

#include "block_cuda.h"
#include "block_internal.h"
#include "block_math.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

namespace ampx {
namespace fp8 {
namespace {

// H = S H16 / 4 as a matrix, for devices other than the CPU and CUDA (a
// CUDA tensor in a build without the kernels): float32 [16, 16], built once: TE's sign vector
// S (get_wgrad_sign_vector, torchao's DEFAULT_SIGN_VECTOR) times the
// Sylvester matrix H16[i][j] = (-1)^popcount(i & j). A plain tensor even
// when first asked for under InferenceMode, so that autograd may save it.
const at::Tensor& cpu_hadamard() {
  static const at::Tensor* h = [] {
    c10::InferenceMode normal_tensors(false);
    auto* m = new at::Tensor(at::empty({16, 16}, at::kFloat));  // kept for the process
    auto a = m->accessor<float, 2>();
    for (int i = 0; i < 16; ++i) {
      for (int j = 0; j < 16; ++j) {
        const float h = block_math::hadamard_factor(i);
        a[i][j] = std::popcount(static_cast<unsigned>(i & j)) % 2 ? -h : h;
      }
    }
    return m;
  }();
  return *h;
}

// H on `device`: copied there once.
at::Tensor hadamard_on(c10::Device device) {
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

// Eight floats, GCC's vector extension: hadamard16_tile on eight tiles at once,
// each lane the float path's operations.
typedef float Lanes __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

// hadamard16 on the CPU: each tile of 16 through block_math's butterflies,
// along the rows (eight tiles a call, transposed into the lanes) or down the
// columns of a 2-D x (eight columns a call); what is left one tile at a time.
at::Tensor cpu_hadamard16(const at::Tensor& v, bool inverse, bool columns) {
  at::Tensor out = at::empty_like(v);
  const float* in = v.data_ptr<float>();
  float* o = out.data_ptr<float>();
  if (columns) {
    const int64_t cols = v.size(1);
    at::parallel_for(0, v.size(0) / 16, 1, [&](int64_t begin, int64_t end) {
      Lanes lanes[16];
      float tile[16];
      for (int64_t band = begin; band < end; ++band) {
        const float* b = in + band * 16 * cols;
        float* ob = o + band * 16 * cols;
        int64_t c = 0;
        for (; c + kLanes <= cols; c += kLanes) {
          for (int i = 0; i < 16; ++i) std::memcpy(&lanes[i], b + i * cols + c, sizeof(Lanes));
          block_math::hadamard16_tile(lanes, inverse);
          for (int i = 0; i < 16; ++i) std::memcpy(ob + i * cols + c, &lanes[i], sizeof(Lanes));
        }
        for (; c < cols; ++c) {
          for (int i = 0; i < 16; ++i) tile[i] = b[i * cols + c];
          block_math::hadamard16_tile(tile, inverse);
          for (int i = 0; i < 16; ++i) ob[i * cols + c] = tile[i];
        }
      }
    });
  } else {
    at::parallel_for(0, v.numel() / 16, 256, [&](int64_t begin, int64_t end) {
      Lanes lanes[16];
      float tile[16];
      int64_t t = begin;
      for (; t + kLanes <= end; t += kLanes) {  // eight tiles, one a lane
        for (int i = 0; i < 16; ++i) {
          for (int l = 0; l < kLanes; ++l) lanes[i][l] = in[(t + l) * 16 + i];
        }
        block_math::hadamard16_tile(lanes, inverse);
        for (int i = 0; i < 16; ++i) {
          for (int l = 0; l < kLanes; ++l) o[(t + l) * 16 + i] = lanes[i][l];
        }
      }
      for (; t < end; ++t) {
        std::copy(in + t * 16, in + t * 16 + 16, tile);
        block_math::hadamard16_tile(tile, inverse);
        std::copy(tile, tile + 16, o + t * 16);
      }
    });
  }
  return out;
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
  const at::Tensor v = x.to(at::kFloat).contiguous();
  if (v.device().is_cpu()) return cpu_hadamard16(v, inverse, columns);
  if (v.is_cuda() && detail::cuda_block::built()) {
    return detail::cuda_block::hadamard16(v, inverse, columns);
  }
  const at::Tensor h = hadamard_on(x.device());
  const at::Tensor m = inverse ? h.t() : h;
  if (columns) {
    // Each column tile c (16 rows) as a row vector: (c^T m)^T = m^T c.
    const at::Tensor tiles = v.reshape({x.size(0) / 16, 16, x.size(1)});
    return at::matmul(m.t(), tiles).reshape(x.sizes());
  }
  return at::mm(v.reshape({-1, 16}), m).view(x.sizes());
}

}  // namespace fp8
}  // namespace ampx
