// ATen's dtype casts, the traffic autocast and O2 add to a step, over 100M
// elements against a plain fp32 copy, at 1 and 2 threads:
//
//   build/host/bench/ampx_cast_bench [--benchmark_filter=...] [--elements=N]
//
// Each cast runs two ways: `dst.copy_(src)` into a preallocated tensor
// (BM_Cast_<from>_<to>_copy_) and `src.to(dtype)` (BM_Cast_<from>_<to>_to),
// which allocates and first-touches its result every call, as autocast's
// casts do. A cast is credited the bytes it moves: N x (source + target
// element size), e.g. 6 B per element for fp32 -> bf16; BM_Copy copies N fp32
// elements, credited 8 B per element. Every transfer also pays the
// write-allocate read of its target, so the ratio is like for like. The
// closing table prints each cast's bandwidth as a fraction of the copy's at
// the same thread count (from --benchmark_out's JSON: bytes_per_second over
// BM_Copy's).

#include "bench_util.h"

#include "ampx/detail/compat.h"

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace {

int64_t g_elements = 100'000'000;

/// One source tensor per dtype (same values) and one preallocated target.
struct Buffers {
  torch::Tensor f32, bf16, f16, dst_f32, dst_bf16, dst_f16;
  static Buffers& get() {
    static Buffers b = [] {
      Buffers x;
      x.f32 = torch::randn({g_elements});
      x.bf16 = x.f32.to(torch::kBFloat16);
      x.f16 = x.f32.to(torch::kHalf);
      x.dst_f32 = torch::zeros_like(x.f32);  // zeros: first touch outside the timing
      x.dst_bf16 = torch::zeros_like(x.bf16);
      x.dst_f16 = torch::zeros_like(x.f16);
      return x;
    }();
    return b;
  }
  torch::Tensor& source(torch::ScalarType t) {
    return t == torch::kFloat ? f32 : t == torch::kBFloat16 ? bf16 : f16;
  }
  torch::Tensor& target(torch::ScalarType t) {
    return t == torch::kFloat ? dst_f32 : t == torch::kBFloat16 ? dst_bf16 : dst_f16;
  }
};

std::string short_name(torch::ScalarType t) {
  return t == torch::kFloat ? "f32" : t == torch::kBFloat16 ? "bf16" : "f16";
}

void BM_Copy(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& b = Buffers::get();
  for (auto _ : state) {
    b.dst_f32.copy_(b.f32);
    benchmark::ClobberMemory();
  }
  ampx::bench::set_traffic(state, g_elements * 8, g_elements, at::get_num_threads());
}

// into a preallocated target: the cast alone
void BM_CastCopy(benchmark::State& state, torch::ScalarType from, torch::ScalarType to) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& b = Buffers::get();
  const auto& src = b.source(from);
  auto& dst = b.target(to);
  for (auto _ : state) {
    dst.copy_(src);
    benchmark::ClobberMemory();
  }
  const int64_t bytes = g_elements * int64_t(c10::elementSize(from) + c10::elementSize(to));
  ampx::bench::set_traffic(state, bytes, g_elements, at::get_num_threads());
}

// .to(): the cast plus allocating and first-touching the result
void BM_CastTo(benchmark::State& state, torch::ScalarType from, torch::ScalarType to) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& b = Buffers::get();
  const auto& src = b.source(from);
  for (auto _ : state) {
    auto dst = src.to(to);
    benchmark::DoNotOptimize(dst.data_ptr());
    benchmark::ClobberMemory();
  }
  const int64_t bytes = g_elements * int64_t(c10::elementSize(from) + c10::elementSize(to));
  ampx::bench::set_traffic(state, bytes, g_elements, at::get_num_threads());
}

}  // namespace

int main(int argc, char** argv) {
  const auto flags = ampx::bench::initialize(argc, argv, g_elements);
  g_elements = flags.elements;
  const auto bandwidth = [&](benchmark::internal::Benchmark* b) {
    ampx::bench::timed(b->Arg(1)->Arg(2), flags, benchmark::kMillisecond, 1.0);
  };
  bandwidth(benchmark::RegisterBenchmark("BM_Copy", BM_Copy));
  // fp32 -> bf16 / fp16: O2 params, autocast inputs; back: grads, masters.
  const std::vector<std::pair<torch::ScalarType, torch::ScalarType>> casts = {
      {torch::kFloat, torch::kBFloat16},
      {torch::kBFloat16, torch::kFloat},
      {torch::kFloat, torch::kHalf},
      {torch::kHalf, torch::kFloat},
  };
  for (const auto& c : casts) {
    const std::string name = "BM_Cast_" + short_name(c.first) + "_" + short_name(c.second);
    bandwidth(
        benchmark::RegisterBenchmark((name + "_copy_").c_str(), BM_CastCopy, c.first, c.second));
    bandwidth(benchmark::RegisterBenchmark((name + "_to").c_str(), BM_CastTo, c.first, c.second));
  }
  benchmark::AddCustomContext("libtorch", ampx::detail::compat::torch_version());
  ampx::bench::print_header(flags, "LibTorch %s, %lld elements (%.0f MB per fp32 buffer)\n",
                            ampx::detail::compat::torch_version(),
                            static_cast<long long>(g_elements), g_elements * 4 / 1e6);
  ampx::bench::run_with_table(flags, [](const ampx::bench::Table& table) {
    ampx::bench::print_bandwidth_table(table, "BM_Copy");
  });
  return 0;
}
