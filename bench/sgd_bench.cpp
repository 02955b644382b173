// Fused mixed-precision SGD step (momentum 0.9) over 100M params against a
// plain copy of the same bytes and against torch::optim::SGD on fp32, at 1
// and 2 threads:
//
//   build/host/bench/ampx_sgd_bench [--benchmark_filter=...] [--elements=N]
//
// ampx: bf16 params + bf16 grads, fp32 master + momentum buffer, credited
// 22 B per element: reads 2 (param; the kernel itself only writes it, the
// cache's write-allocate reads it) + 2 (grad) + 4 (master) + 4 (buffer),
// writes 2 + 4 + 4. BM_Copy copies 11 B per element (22 B moved, plus its
// own write-allocate read). torch::optim::SGD steps the same count of fp32
// params in two ATen passes (buf = buf * momentum + grad; p -= lr * buf).
// The closing table is optim_bench's: ampx's bandwidth as a fraction of the
// copy's and its step time against LibTorch's (from --benchmark_out's JSON:
// bytes_per_second over BM_Copy's, real_time of BM_SGDTorchFp32 over
// BM_SGDAmpxBf16's at the same thread count).

#include "bench_util.h"

#include "ampx/detail/compat.h"
#include "ampx/optim.h"

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <memory>
#include <utility>
#include <vector>

namespace {

int64_t g_elements = 100'000'000;
constexpr int64_t kBytesPerElement = 22;
constexpr double kLr = 1e-2;
constexpr double kMomentum = 0.9;

struct AmpxSetup {
  torch::Tensor param;
  std::unique_ptr<ampx::optim::SGD> opt;
  static AmpxSetup& get() {
    static AmpxSetup s = [] {
      AmpxSetup x;
      x.param = (torch::randn({g_elements}) * 0.1).to(torch::kBFloat16).requires_grad_();
      x.param.mutable_grad() = (torch::randn({g_elements}) * 1e-3).to(torch::kBFloat16);
      x.opt = std::make_unique<ampx::optim::SGD>(std::vector<torch::Tensor>{x.param},
                                                 ampx::optim::SGDOptions(kLr).momentum(kMomentum));
      x.opt->step();  // allocate master and momentum buffer outside the timing
      return x;
    }();
    return s;
  }
};

struct TorchSetup {
  torch::Tensor param;
  std::unique_ptr<torch::optim::SGD> opt;
  static TorchSetup& get() {
    static TorchSetup s = [] {
      TorchSetup x;
      x.param = (torch::randn({g_elements}) * 0.1).requires_grad_();
      x.param.mutable_grad() = torch::randn({g_elements}) * 1e-3;
      x.opt = std::make_unique<torch::optim::SGD>(
          std::vector<torch::Tensor>{x.param}, torch::optim::SGDOptions(kLr).momentum(kMomentum));
      x.opt->step();  // the first step clones the grad into the buffer
      return x;
    }();
    return s;
  }
};

void BM_Copy(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  // 11 bytes per element each way: 22 B moved per element, as the fused step.
  static torch::Tensor src = torch::randn({g_elements * kBytesPerElement / 2 / 4});
  static torch::Tensor dst = torch::zeros_like(src);  // zeros: first touch outside the timing
  for (auto _ : state) {
    dst.copy_(src);
    benchmark::ClobberMemory();
  }
  ampx::bench::set_traffic(state, g_elements * kBytesPerElement, g_elements, at::get_num_threads());
}

void BM_SGDAmpxBf16(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& s = AmpxSetup::get();
  for (auto _ : state) {
    s.opt->step();
    benchmark::ClobberMemory();
  }
  ampx::bench::set_traffic(state, g_elements * kBytesPerElement, g_elements, at::get_num_threads());
}

void BM_SGDTorchFp32(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& s = TorchSetup::get();
  for (auto _ : state) {
    s.opt->step();
    benchmark::ClobberMemory();
  }
  // No bytes credited (its passes move more): compared by time per step.
  state.counters["threads"] = at::get_num_threads();
  state.counters["elements"] = static_cast<double>(g_elements);
}

}  // namespace

int main(int argc, char** argv) {
  const auto flags = ampx::bench::initialize(argc, argv, g_elements);
  g_elements = flags.elements;
  for (const auto& b :
       {std::make_pair("BM_Copy", BM_Copy), std::make_pair("BM_SGDAmpxBf16", BM_SGDAmpxBf16),
        std::make_pair("BM_SGDTorchFp32", BM_SGDTorchFp32)}) {
    ampx::bench::timed(benchmark::RegisterBenchmark(b.first, b.second)->Arg(1)->Arg(2), flags,
                       benchmark::kMillisecond, 1.0);
  }
  benchmark::AddCustomContext("libtorch", ampx::detail::compat::torch_version());
  ampx::bench::print_header(flags,
                            "LibTorch %s, %lld params, momentum %.1f; ampx: bf16 params/grads + "
                            "fp32 master/buffer (credited %lld B/element); torch: fp32\n",
                            ampx::detail::compat::torch_version(),
                            static_cast<long long>(g_elements), kMomentum,
                            static_cast<long long>(kBytesPerElement));
  ampx::bench::run_with_table(flags, [](const ampx::bench::Table& table) {
    ampx::bench::print_optimizer_table(table, "BM_Copy", "BM_SGDAmpxBf16", "BM_SGDTorchFp32");
  });
  return 0;
}
