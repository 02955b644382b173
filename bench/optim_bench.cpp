// Fused mixed-precision AdamW step over 100M params against a plain copy of
// the same bytes and against torch::optim::AdamW on fp32, at 1 and 2 threads:
//
//   build/host/bench/ampx_optim_bench [--benchmark_filter=...] [--elements=N]
//
// ampx: bf16 params + bf16 grads, fp32 master + exp_avg + exp_avg_sq,
// credited 30 B per element: reads 2 (param; the kernel itself only writes
// it, the cache's write-allocate reads it) + 2 (grad) + 4 + 4 + 4, writes
// 2 + 4 + 4 + 4. BM_Copy copies 15 B per element (30 B moved, plus its own
// write-allocate read, which is why the fused step can beat it).
// torch::optim::AdamW steps the same count of fp32 params (its several
// ATen passes). The closing table prints ampx's bandwidth as a fraction of
// the copy's and its step time against LibTorch's; from --benchmark_out's
// JSON: bytes_per_second over BM_Copy's, real_time of BM_AdamWTorchFp32 over
// BM_AdamWAmpxBf16's at the same thread count.

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
constexpr int64_t kBytesPerElement = 30;

struct AmpxSetup {
  torch::Tensor param;
  std::unique_ptr<ampx::optim::AdamW> opt;
  static AmpxSetup& get() {
    static AmpxSetup s = [] {
      AmpxSetup x;
      x.param = (torch::randn({g_elements}) * 0.1).to(torch::kBFloat16).requires_grad_();
      x.param.mutable_grad() = (torch::randn({g_elements}) * 1e-3).to(torch::kBFloat16);
      x.opt = std::make_unique<ampx::optim::AdamW>(std::vector<torch::Tensor>{x.param},
                                                   ampx::optim::AdamWOptions(1e-4));
      x.opt->step();  // allocate master and moments outside the timing
      return x;
    }();
    return s;
  }
};

struct TorchSetup {
  torch::Tensor param;
  std::unique_ptr<torch::optim::AdamW> opt;
  static TorchSetup& get() {
    static TorchSetup s = [] {
      TorchSetup x;
      x.param = (torch::randn({g_elements}) * 0.1).requires_grad_();
      x.param.mutable_grad() = torch::randn({g_elements}) * 1e-3;
      x.opt = std::make_unique<torch::optim::AdamW>(std::vector<torch::Tensor>{x.param},
                                                    torch::optim::AdamWOptions(1e-4));
      x.opt->step();
      return x;
    }();
    return s;
  }
};

void BM_Copy(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  // 15 bytes per element each way: 30 B moved per element, as the fused step.
  static torch::Tensor src = torch::randn({g_elements * kBytesPerElement / 2 / 4});
  static torch::Tensor dst = torch::zeros_like(src);  // zeros: first touch outside the timing
  for (auto _ : state) {
    dst.copy_(src);
    benchmark::ClobberMemory();
  }
  ampx::bench::set_traffic(state, g_elements * kBytesPerElement, g_elements, at::get_num_threads());
}

void BM_AdamWAmpxBf16(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& s = AmpxSetup::get();
  for (auto _ : state) {
    s.opt->step();
    benchmark::ClobberMemory();
  }
  ampx::bench::set_traffic(state, g_elements * kBytesPerElement, g_elements, at::get_num_threads());
}

void BM_AdamWTorchFp32(benchmark::State& state) {
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
       {std::make_pair("BM_Copy", BM_Copy), std::make_pair("BM_AdamWAmpxBf16", BM_AdamWAmpxBf16),
        std::make_pair("BM_AdamWTorchFp32", BM_AdamWTorchFp32)}) {
    ampx::bench::timed(benchmark::RegisterBenchmark(b.first, b.second)->Arg(1)->Arg(2), flags,
                       benchmark::kMillisecond, 1.0);
  }
  benchmark::AddCustomContext("libtorch", ampx::detail::compat::torch_version());
  ampx::bench::print_header(flags,
                            "LibTorch %s, %lld params; ampx: bf16 params/grads + fp32 "
                            "master/moments (credited %lld B/element); torch: fp32\n",
                            ampx::detail::compat::torch_version(),
                            static_cast<long long>(g_elements),
                            static_cast<long long>(kBytesPerElement));
  ampx::bench::run_with_table(flags, [](const ampx::bench::Table& table) {
    ampx::bench::print_optimizer_table(table, "BM_Copy", "BM_AdamWAmpxBf16", "BM_AdamWTorchFp32");
  });
  return 0;
}
