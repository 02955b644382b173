// Non-finite check + unscale over 100M fp32 gradient elements against a plain
// copy of the same bytes, at 1 and 2 threads, in one run:
//
//   build/host/bench/ampx_bench [--benchmark_filter=...] [--elements=N]
//
// Both are credited 2 x 400 MB (read + write) per iteration; bytes_per_second
// is that over the time. A copy also reads its target once (write-allocate),
// so in-place kernels can beat it; BM_InplaceMulAten (g *= s, no check) is the
// in-place roofline. At the end a table prints each kernel's bandwidth as
// a fraction of the copy's at the same thread count.

#include "ampx/detail/compat.h"
#include "ampx/detail/kernels.h"
#include "ampx/kernels.h"

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <string>

namespace {

int64_t g_elements = 100'000'000;

struct Buffers {
  torch::Tensor src, dst, grad, found, inv;
  static Buffers& get() {
    static Buffers b = [] {
      Buffers x;
      x.src = torch::randn({g_elements});
      x.dst = torch::empty_like(x.src);
      x.grad = x.src.clone();
      x.found = torch::zeros({1});
      x.inv = torch::ones({1});  // keeps values stable across iterations
      return x;
    }();
    return b;
  }
};

void set_traffic(benchmark::State& state) {
  state.SetBytesProcessed(state.iterations() * g_elements * int64_t(sizeof(float)) * 2);
  state.counters["threads"] = static_cast<double>(at::get_num_threads());
}

void BM_Copy(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& b = Buffers::get();
  for (auto _ : state) {
    b.dst.copy_(b.src);
    benchmark::DoNotOptimize(b.dst.data_ptr());
    benchmark::ClobberMemory();
  }
  set_traffic(state);
}

// ATen's in-place multiply of the same bytes: the fair roofline for an
// in-place kernel (a copy also pays the write-allocate read of its target).
void BM_InplaceMulAten(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& b = Buffers::get();
  for (auto _ : state) {
    b.grad.mul_(b.inv);
    benchmark::ClobberMemory();
  }
  set_traffic(state);
}

void BM_UnscaleAmpxCpu(benchmark::State& state, ampx::detail::cpu::Isa isa) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& b = Buffers::get();
  for (auto _ : state) {
    ampx::detail::cpu::non_finite_check_and_unscale_({b.grad}, b.found, b.inv, isa);
    benchmark::ClobberMemory();
  }
  set_traffic(state);
}

void BM_UnscaleComposite(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& b = Buffers::get();
  for (auto _ : state) {
    ampx::detail::non_finite_check_and_unscale_composite_({b.grad}, b.found, b.inv);
    benchmark::ClobberMemory();
  }
  set_traffic(state);
}

void BM_UnscaleAten(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& b = Buffers::get();
  for (auto _ : state) {
    at::_amp_foreach_non_finite_check_and_unscale_({b.grad}, b.found, b.inv);
    benchmark::ClobberMemory();
  }
  set_traffic(state);
}

#define AMPX_BANDWIDTH_ARGS \
  Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0)

BENCHMARK(BM_Copy)->AMPX_BANDWIDTH_ARGS;
BENCHMARK(BM_InplaceMulAten)->AMPX_BANDWIDTH_ARGS;
BENCHMARK(BM_UnscaleComposite)->AMPX_BANDWIDTH_ARGS;

// Console output plus a closing table of bandwidth relative to BM_Copy.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& run : runs) {
      const auto it = run.counters.find("bytes_per_second");
      if (it == run.counters.end()) continue;
      // "BM_Copy/2/min_time:2.000/real_time" -> "BM_Copy/2"
      std::string name = run.benchmark_name();
      const auto first = name.find('/');
      name = name.substr(0, name.find('/', first + 1));
      gbps_[name] = it->second.value / 1e9;
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\n%-28s %8s %10s %10s\n", "kernel (threads)", "GB/s", "copy GB/s", "vs copy");
    for (const auto& entry : gbps_) {
      const auto slash = entry.first.find('/');
      const std::string threads = entry.first.substr(slash);
      const auto copy = gbps_.find("BM_Copy" + threads);
      if (copy == gbps_.end() || entry.first.rfind("BM_Copy", 0) == 0) continue;
      std::printf("%-28s %8.2f %10.2f %9.0f%%\n", entry.first.c_str(), entry.second, copy->second,
                  100.0 * entry.second / copy->second);
    }
  }

 private:
  std::map<std::string, double> gbps_;
};

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--elements=", 11) == 0) g_elements = std::atoll(argv[i] + 11);
  }
  benchmark::Initialize(&argc, argv);
  // ampx's kernel once per instruction set this CPU runs (the best is default).
  for (auto isa : ampx::detail::cpu::supported_isas()) {
    const std::string name = "BM_UnscaleAmpx_" + ampx::detail::cpu::isa_name(isa);
    benchmark::RegisterBenchmark(name.c_str(), BM_UnscaleAmpxCpu, isa)->AMPX_BANDWIDTH_ARGS;
  }
  // ATen's CPU kernel exists from LibTorch 2.3 on: compared where present.
  if (ampx::detail::compat::has_native_kernel("aten::_amp_foreach_non_finite_check_and_unscale_",
                                              c10::DeviceType::CPU)) {
    benchmark::RegisterBenchmark("BM_UnscaleAten", BM_UnscaleAten)->AMPX_BANDWIDTH_ARGS;
  }
  std::printf("LibTorch %s, %lld fp32 elements (%.0f MB per buffer)\n",
              ampx::detail::compat::torch_version(), static_cast<long long>(g_elements),
              g_elements * 4 / 1e6);
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
