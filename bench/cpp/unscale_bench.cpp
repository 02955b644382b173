// Non-finite check + unscale over 100M fp32 gradient elements against a plain
// copy of the same bytes, at 1 and 2 threads, in one run:
//
//   build/host/bench/ampx_bench [--benchmark_filter=...] [--elements=N]
//
// Both are credited 2 x 400 MB (read + write) per iteration; bytes_per_second
// is that over the time. A copy also reads its target once (write-allocate),
// so in-place kernels can beat it; BM_InplaceMulAten (g *= s, no check) is the
// in-place roofline. At the end a table prints each kernel's bandwidth as
// a fraction of the copy's at the same thread count (from the JSON of
// --benchmark_out: bytes_per_second over BM_Copy's; see bench_util.h).

#include "bench_util.h"

#include "ampx/detail/compat.h"
#include "ampx/detail/kernels.h"
#include "ampx/kernels.h"

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>

namespace {

int64_t g_elements = 100'000'000;

struct Buffers {
  torch::Tensor src, dst, grad, found, inv;
  static Buffers& get() {
    static Buffers b = [] {
      Buffers x;
      x.src = torch::randn({g_elements});
      x.dst = torch::zeros_like(x.src);  // zeros: first touch outside the timing
      x.grad = x.src.clone();
      x.found = torch::zeros({1});
      x.inv = torch::ones({1});  // keeps values stable across iterations
      return x;
    }();
    return b;
  }
};

void set_traffic(benchmark::State& state) {
  ampx::bench::set_traffic(state, g_elements * int64_t(sizeof(float)) * 2, g_elements,
                           at::get_num_threads());
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

}  // namespace

int main(int argc, char** argv) {
  const auto flags = ampx::bench::initialize(argc, argv, g_elements);
  g_elements = flags.elements;
  const auto bandwidth = [&](benchmark::internal::Benchmark* b) {
    ampx::bench::timed(b->Arg(1)->Arg(2), flags, benchmark::kMillisecond, 2.0);
  };
  bandwidth(benchmark::RegisterBenchmark("BM_Copy", BM_Copy));
  bandwidth(benchmark::RegisterBenchmark("BM_InplaceMulAten", BM_InplaceMulAten));
  bandwidth(benchmark::RegisterBenchmark("BM_UnscaleComposite", BM_UnscaleComposite));
  // ampx's kernel once per instruction set this CPU runs (the best is default).
  for (auto isa : ampx::detail::cpu::supported_isas()) {
    // (unscaling's build on AVX512-BF16 CPUs is the avx512 one)
    if (isa == ampx::detail::cpu::Isa::kAvx512Bf16) continue;
    const std::string name = "BM_UnscaleAmpx_" + ampx::detail::cpu::isa_name(isa);
    bandwidth(benchmark::RegisterBenchmark(name.c_str(), BM_UnscaleAmpxCpu, isa));
  }
  // ATen's CPU kernel exists from LibTorch 2.3 on: compared where present.
  if (ampx::detail::compat::has_native_kernel("aten::_amp_foreach_non_finite_check_and_unscale_",
                                              c10::DeviceType::CPU)) {
    bandwidth(benchmark::RegisterBenchmark("BM_UnscaleAten", BM_UnscaleAten));
  }
  benchmark::AddCustomContext("libtorch", ampx::detail::compat::torch_version());
  ampx::bench::print_header(flags, "LibTorch %s, %lld fp32 elements (%.0f MB per buffer)\n",
                            ampx::detail::compat::torch_version(),
                            static_cast<long long>(g_elements), g_elements * 4 / 1e6);
  ampx::bench::run_with_table(flags, [](const ampx::bench::Table& table) {
    ampx::bench::print_bandwidth_table(table, "BM_Copy");
  });
  return 0;
}
