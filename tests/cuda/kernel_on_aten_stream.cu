// A CUDA kernel launched on ATen's current stream, on memory from LibTorch's
// caching allocator, checked against the same arithmetic on the CPU. nvcc
// compiles it in every CUDA build of ampx (make test's CUDA leg, which has no
// GPU), so that a CUDA-only compile or link error fails the build there; it
// runs where a GPU is (scripts/device-test.sh). Exit 77: no CUDA device.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <cstdio>

namespace {

// y = 2 x + y: the product is exact, so the GPU (fused) and the CPU round
// the same sum once and must agree bitwise.
__global__ void twice_x_plus_y(const float* x, float* y, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = 2.0f * x[i] + y[i];
}

}  // namespace

int main() {
  if (!at::cuda::is_available()) {
    std::printf("no CUDA device\n");
    return 77;
  }
  const int64_t n = 1 << 20;
  const auto x = at::randn({n}), y = at::randn({n});
  auto x_gpu = x.cuda(), y_gpu = y.cuda();
  constexpr int kThreads = 256;
  const auto blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  twice_x_plus_y<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      x_gpu.data_ptr<float>(), y_gpu.data_ptr<float>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto want = 2 * x + y;
  if (!at::equal(y_gpu.cpu(), want)) {
    std::printf("kernel_on_aten_stream: the GPU's 2x + y differs from the CPU's\n");
    return 1;
  }
  std::printf("kernel_on_aten_stream: %lld elements agree bitwise\n", static_cast<long long>(n));
  return 0;
}
