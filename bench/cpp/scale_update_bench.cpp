// The loss-scale update: a tiny op paid once per step, so its cost is
// latency (dispatch and bookkeeping), not bandwidth. Microseconds per call,
// with found_inf 0 (the steady state) and 1 (backoff):
//
//   build/host/bench/ampx_scale_update_bench [--benchmark_filter=...]
//
// BM_CopyScalars copies the 16 bytes the update touches (scale, two
// trackers, found_inf: 4 x 4 B) with one copy_, the floor of any ATen call.
// BM_UpdateScaleAmpx is ampx::update_scale_ (on the CPU: plain scalar code,
// no ATen op); BM_UpdateScaleComposite the ATen-op version ampx runs where
// no kernel fits; BM_UpdateScaleAten ATen's own `_amp_update_scale_`, where
// this LibTorch has it for the CPU (2.3 on). BM_GradScalerUnscaleUpdate is
// one GradScaler iteration's bookkeeping around a 1-element gradient:
// unscale_(optimizer) + update(); BM_UnscaleOneElement the unscale kernel of
// that same gradient, for the difference. The closing table prints each
// latency and its multiple of the copy's (from --benchmark_out's JSON:
// real_time over BM_CopyScalars'; the `found_inf` counter gives the case).

#include "bench_util.h"

#include "ampx/detail/compat.h"
#include "ampx/detail/kernels.h"
#include "ampx/grad_scaler.h"
#include "ampx/kernels.h"

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <cstdio>
#include <vector>

namespace {

// scale float32 [1], trackers int32 [1], found_inf float32 [1]: the
// documented operands of ampx::update_scale_ and ATen's kernel.
struct ScaleState {
  torch::Tensor scale = torch::full({1}, 65536.0f);
  torch::Tensor growth = torch::zeros({1}, torch::kInt);
  torch::Tensor hysteresis = torch::ones({1}, torch::kInt);
  torch::Tensor found;
  explicit ScaleState(benchmark::State& state)
      : found(torch::full({1}, static_cast<float>(state.range(0)))) {
    state.counters["found_inf"] = static_cast<double>(state.range(0));
  }
};

const ampx::ScaleUpdateRule kRule;  // PyTorch's defaults: 2.0, 0.5, 2000, hysteresis 1

void BM_CopyScalars(benchmark::State& state) {
  auto src = torch::ones({4});
  auto dst = torch::empty_like(src);
  for (auto _ : state) {
    dst.copy_(src);
    benchmark::ClobberMemory();
  }
}

void BM_UpdateScaleAmpx(benchmark::State& state) {
  ScaleState s(state);
  for (auto _ : state) {
    ampx::update_scale_(s.scale, s.growth, s.hysteresis, s.found, kRule);
    benchmark::ClobberMemory();
  }
}

void BM_UpdateScaleComposite(benchmark::State& state) {
  ScaleState s(state);
  for (auto _ : state) {
    ampx::detail::update_scale_composite_(s.scale, s.growth, s.hysteresis, s.found, kRule);
    benchmark::ClobberMemory();
  }
}

void BM_UpdateScaleAten(benchmark::State& state) {
  ScaleState s(state);
  for (auto _ : state) {
    at::_amp_update_scale_(s.scale, s.growth, s.found, kRule.growth_factor, kRule.backoff_factor,
                           kRule.growth_interval);
    benchmark::ClobberMemory();
  }
}

// One fp32 param of one element whose grad stays 0 (finite, unchanged by unscaling).
struct TinyModel {
  torch::Tensor param = torch::zeros({1}).requires_grad_();
  torch::optim::SGD opt{std::vector<torch::Tensor>{param}, torch::optim::SGDOptions(0.1)};
  TinyModel() { param.mutable_grad() = torch::zeros({1}); }
};

void BM_GradScalerUnscaleUpdate(benchmark::State& state) {
  TinyModel m;
  ampx::GradScaler scaler;
  benchmark::DoNotOptimize(scaler.scale(m.param));  // creates the scale on the CPU
  for (auto _ : state) {
    scaler.unscale_(m.opt);
    scaler.update();
    benchmark::ClobberMemory();
  }
}

void BM_UnscaleOneElement(benchmark::State& state) {
  TinyModel m;
  auto found = torch::zeros({1});
  auto inv_scale = torch::full({1}, 1.0f / 65536);
  std::vector<torch::Tensor> grads{m.param.mutable_grad()};
  for (auto _ : state) {
    ampx::non_finite_check_and_unscale_(grads, found, inv_scale);
    benchmark::ClobberMemory();
  }
}

void print_latency_table(const ampx::bench::Table& table) {
  const ampx::bench::Result* copy = nullptr;
  const auto none = table.find("");
  if (none != table.end()) copy = ampx::bench::find(none->second, "BM_CopyScalars");
  std::printf("%-28s %9s %10s %12s\n", "op", "found_inf", "us/call", "x copy_");
  for (const auto& entry : table) {
    for (const auto& op : entry.second) {
      const double us = op.second.ms * 1e3;
      std::printf("%-28s %9s %10.3f", op.first.c_str(),
                  entry.first.empty() ? "-" : entry.first.c_str(), us);
      if (copy != nullptr && copy->ms > 0) {
        std::printf(" %11.2fx\n", op.second.ms / copy->ms);
      } else {
        std::printf(" %12s\n", "-");
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  // --elements=N is accepted for symmetry with the other programs; nothing here scales with it.
  const auto flags = ampx::bench::initialize(argc, argv, 0);
  const auto latency = [&](benchmark::internal::Benchmark* b) {
    ampx::bench::timed(b, flags, benchmark::kMicrosecond, 0.5);
  };
  latency(benchmark::RegisterBenchmark("BM_CopyScalars", BM_CopyScalars));
  latency(benchmark::RegisterBenchmark("BM_UpdateScaleAmpx", BM_UpdateScaleAmpx)->Arg(0)->Arg(1));
  latency(benchmark::RegisterBenchmark("BM_UpdateScaleComposite", BM_UpdateScaleComposite)
              ->Arg(0)
              ->Arg(1));
  // ATen's CPU kernel exists from LibTorch 2.3 on: compared where present.
  const bool aten =
      ampx::detail::compat::has_native_kernel("aten::_amp_update_scale_", c10::DeviceType::CPU);
  if (aten) {
    latency(benchmark::RegisterBenchmark("BM_UpdateScaleAten", BM_UpdateScaleAten)->Arg(0)->Arg(1));
  }
  latency(benchmark::RegisterBenchmark("BM_GradScalerUnscaleUpdate", BM_GradScalerUnscaleUpdate));
  latency(benchmark::RegisterBenchmark("BM_UnscaleOneElement", BM_UnscaleOneElement));
  benchmark::AddCustomContext("libtorch", ampx::detail::compat::torch_version());
  ampx::bench::print_header(flags, "LibTorch %s; ATen's _amp_update_scale_ on the CPU: %s\n",
                            ampx::detail::compat::torch_version(), aten ? "yes" : "no");
  ampx::bench::run_with_table(flags, print_latency_table);
  return 0;
}
