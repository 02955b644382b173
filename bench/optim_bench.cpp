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
// the copy's and its step time against LibTorch's.

#include "ampx/detail/compat.h"
#include "ampx/optim.h"

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <string>

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
  static torch::Tensor dst = torch::empty_like(src);
  for (auto _ : state) {
    dst.copy_(src);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * g_elements * kBytesPerElement);
}

void BM_AdamWAmpxBf16(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& s = AmpxSetup::get();
  for (auto _ : state) {
    s.opt->step();
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * g_elements * kBytesPerElement);
}

void BM_AdamWTorchFp32(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& s = TorchSetup::get();
  for (auto _ : state) {
    s.opt->step();
    benchmark::ClobberMemory();
  }
}

#define AMPX_OPTIM_ARGS Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0)

BENCHMARK(BM_Copy)->AMPX_OPTIM_ARGS;
BENCHMARK(BM_AdamWAmpxBf16)->AMPX_OPTIM_ARGS;
BENCHMARK(BM_AdamWTorchFp32)->AMPX_OPTIM_ARGS;

// Console output plus a closing table per thread count.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& run : runs) {
      // "BM_Copy/2/min_time:1.000/real_time" -> name "BM_Copy", threads "2"
      const std::string full = run.benchmark_name();
      const auto a = full.find('/');
      const std::string name = full.substr(0, a);
      const std::string threads = full.substr(a + 1, full.find('/', a + 1) - a - 1);
      auto& row = rows_[threads];
      const double ms = run.GetAdjustedRealTime();  // in the run's unit: ms
      row[name + ".ms"] = ms;
      const auto it = run.counters.find("bytes_per_second");
      if (it != run.counters.end()) row[name + ".gbps"] = it->second.value / 1e9;
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\n%-8s %10s %12s %9s %14s %14s %9s\n", "threads", "copy GB/s", "ampx GB/s",
                "vs copy", "ampx ms/step", "torch ms/step", "speedup");
    for (auto& entry : rows_) {
      auto& r = entry.second;
      std::printf("%-8s %10.2f %12.2f %8.0f%% %14.1f %14.1f %8.2fx\n", entry.first.c_str(),
                  r["BM_Copy.gbps"], r["BM_AdamWAmpxBf16.gbps"],
                  100.0 * r["BM_AdamWAmpxBf16.gbps"] / r["BM_Copy.gbps"], r["BM_AdamWAmpxBf16.ms"],
                  r["BM_AdamWTorchFp32.ms"], r["BM_AdamWTorchFp32.ms"] / r["BM_AdamWAmpxBf16.ms"]);
    }
  }

 private:
  std::map<std::string, std::map<std::string, double>> rows_;
};

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--elements=", 11) == 0) g_elements = std::atoll(argv[i] + 11);
  }
  benchmark::Initialize(&argc, argv);
  std::printf(
      "LibTorch %s, %lld params; ampx: bf16 params/grads + fp32 master/moments "
      "(credited %lld B/element); torch: fp32\n",
      ampx::detail::compat::torch_version(), static_cast<long long>(g_elements),
      static_cast<long long>(kBytesPerElement));
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
