// A fused mixed-precision optimizer step over 100M params against a plain
// copy of the same bytes and against LibTorch's own optimizer on fp32 (where
// it has one), at 1 and 2 threads; one program, the optimizer chosen by flag:
//
//   build/host/bench/ampx_optim_bench [--optimizer=adamw|sgd|lamb] [--elements=N]
//                                     [--masters=fp32|kahan|stochastic]
//                                     [--state=fp32|bf16|fp8|8bit] [--benchmark_filter=...]
//
// ampx: bf16 params + bf16 grads, fp32 master and states. Each optimizer is
// credited the bytes its fused pass must move per element, reads 2 (param;
// the kernel itself only writes it, the cache's write-allocate reads it) + 2
// (grad) + 4 (master) + 4 per state, writes 2 + 4 + 4 per state:
//   adamw: exp_avg + exp_avg_sq, 30 B; torch::optim::AdamW (several ATen passes)
//   sgd:   momentum 0.9 buffer, 22 B; torch::optim::SGD (two ATen passes:
//          buf = buf * momentum + grad; p -= lr * buf)
//   lamb:  exp_avg + exp_avg_sq, credited AdamW's 30 B although its trust
//          ratio needs norms of the weight and the update (more traffic), so
//          its GB/s is a lower bound; LibTorch has no LAMB to compare with.
// --masters and --state change ampx's side (ampx::optim's master weights and
// StateFormat) and its credited bytes: kahan reads and writes a 2-byte
// compensation instead of the 4-byte master, stochastic neither; a moment
// moves 8 bytes in fp32, 4 in bf16, 2 in fp8 / 8bit (scales: 8 bytes a block
// of 256, not credited).
// BM_Copy copies half the credited bytes (the same bytes moved, plus its own
// write-allocate read, which is why a fused step can beat it). The closing
// table shows ampx's bandwidth as a fraction of the copy's and its step time
// against LibTorch's; from --benchmark_out's JSON: bytes_per_second over
// BM_Copy's, real_time of BM_<Opt>TorchFp32 over BM_<Opt>AmpxBf16's at the
// same thread count.

#include "bench_util.h"

#include "ampx/detail/compat.h"
#include "ampx/optim.h"

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace {

/// One optimizer of the program: LibTorch's (ampx's: make_ampx below).
struct OptimizerCase {
  std::string flag;   // --optimizer=...
  std::string bench;  // benchmark names: BM_<bench>AmpxBf16, BM_<bench>TorchFp32
  int64_t bytes_per_element;  // with fp32 masters and moments
  // null: LibTorch has no such optimizer
  std::function<std::unique_ptr<torch::optim::Optimizer>(const torch::Tensor&)> torch;
};

constexpr double kSgdLr = 1e-2;
constexpr double kMomentum = 0.9;

const std::vector<OptimizerCase>& cases() {
  static const std::vector<OptimizerCase> all = {
      {"adamw", "AdamW", 30,
       [](const torch::Tensor& p) {
         return std::make_unique<torch::optim::AdamW>(std::vector<torch::Tensor>{p},
                                                      torch::optim::AdamWOptions(1e-4));
       }},
      {"sgd", "SGD", 22,
       [](const torch::Tensor& p) {
         return std::make_unique<torch::optim::SGD>(
             std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(kSgdLr).momentum(kMomentum));
       }},
      {"lamb", "LAMB", 30, nullptr},
  };
  return all;
}

const OptimizerCase* g_case = nullptr;
int64_t g_elements = 100'000'000;
std::string g_masters = "fp32", g_state = "fp32";

/// The bytes ampx's step is credited per element under --masters and --state.
int64_t ampx_bytes_per_element() {
  const int64_t moments = g_case->flag == "sgd" ? 1 : 2;
  const int64_t fp32_masters_and_states = g_case->bytes_per_element;
  const int64_t base = fp32_masters_and_states - 8 * moments;  // param, grad, master: 14
  const int64_t weights = g_masters == "fp32" ? base : g_masters == "kahan" ? base - 4 : base - 8;
  const int64_t per_moment = g_state == "fp32" ? 8 : g_state == "bf16" ? 4 : 2;
  return weights + per_moment * moments;
}

/// ampx's optimizer of the case, under --masters and --state.
std::unique_ptr<torch::optim::Optimizer> make_ampx(const torch::Tensor& p) {
  const auto format = ampx::optim::state_format_from_name(g_state);
  const bool masters = g_masters == "fp32";
  const std::vector<torch::Tensor> params{p};
  if (g_case->flag == "sgd") {
    return std::make_unique<ampx::optim::SGD>(params,
                                              ampx::optim::SGDOptions(kSgdLr)
                                                  .momentum(kMomentum)
                                                  .master_weights(masters)
                                                  .kahan_summation(g_masters == "kahan")
                                                  .stochastic_rounding(g_masters == "stochastic")
                                                  .state_format(format));
  }
  if (g_case->flag == "lamb") {
    return std::make_unique<ampx::optim::LAMB>(params,
                                               ampx::optim::LAMBOptions(1e-4)
                                                   .master_weights(masters)
                                                   .kahan_summation(g_masters == "kahan")
                                                   .stochastic_rounding(g_masters == "stochastic")
                                                   .state_format(format));
  }
  return std::make_unique<ampx::optim::AdamW>(params,
                                              ampx::optim::AdamWOptions(1e-4)
                                                  .master_weights(masters)
                                                  .kahan_summation(g_masters == "kahan")
                                                  .stochastic_rounding(g_masters == "stochastic")
                                                  .state_format(format));
}

/// A param of g_elements with a gradient, and its optimizer stepped once
/// (masters and states allocated outside the timing).
struct Setup {
  torch::Tensor param;
  std::unique_ptr<torch::optim::Optimizer> opt;
  static Setup make(
      torch::ScalarType dtype,
      const std::function<std::unique_ptr<torch::optim::Optimizer>(const torch::Tensor&)>&
          make_optimizer) {
    Setup x;
    x.param = (torch::randn({g_elements}) * 0.1).to(dtype).requires_grad_();
    x.param.mutable_grad() = (torch::randn({g_elements}) * 1e-3).to(dtype);
    x.opt = make_optimizer(x.param);
    x.opt->step();
    return x;
  }
};

Setup& ampx_setup() {
  static Setup s = Setup::make(torch::kBFloat16, make_ampx);
  return s;
}

Setup& torch_setup() {
  static Setup s = Setup::make(torch::kFloat, g_case->torch);
  return s;
}

void BM_Copy(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  const int64_t bytes = ampx_bytes_per_element();
  // Half the credited bytes each way: as many bytes moved as the fused step.
  static torch::Tensor src = torch::randn({g_elements * bytes / 2 / 4});
  static torch::Tensor dst = torch::zeros_like(src);  // zeros: first touch outside the timing
  for (auto _ : state) {
    dst.copy_(src);
    benchmark::ClobberMemory();
  }
  ampx::bench::set_traffic(state, g_elements * bytes, g_elements, at::get_num_threads());
}

void BM_AmpxBf16(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& s = ampx_setup();
  for (auto _ : state) {
    s.opt->step();
    benchmark::ClobberMemory();
  }
  ampx::bench::set_traffic(state, g_elements * ampx_bytes_per_element(), g_elements,
                           at::get_num_threads());
}

void BM_TorchFp32(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto& s = torch_setup();
  for (auto _ : state) {
    s.opt->step();
    benchmark::ClobberMemory();
  }
  // No bytes credited (its passes move more): compared by time per step.
  state.counters["threads"] = at::get_num_threads();
  state.counters["elements"] = static_cast<double>(g_elements);
}

/// Takes --optimizer=NAME, --masters= and --state= out of argv; nullptr (after
/// a message) for an unknown name.
const OptimizerCase* take_optimizer_flag(int& argc, char** argv) {
  std::string name = "adamw";
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--optimizer=", 12) == 0) {
      name = argv[i] + 12;
    } else if (std::strncmp(argv[i], "--masters=", 10) == 0) {
      g_masters = argv[i] + 10;
    } else if (std::strncmp(argv[i], "--state=", 8) == 0) {
      g_state = argv[i] + 8;
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  if (g_masters != "fp32" && g_masters != "kahan" && g_masters != "stochastic") {
    std::fprintf(stderr, "ampx_optim_bench: --masters=%s: expected fp32, kahan or stochastic\n",
                 g_masters.c_str());
    return nullptr;
  }
  (void)ampx::optim::state_format_from_name(g_state);  // throws naming it
  for (const auto& c : cases()) {
    if (c.flag == name) return &c;
  }
  std::fprintf(stderr, "ampx_optim_bench: --optimizer=%s: expected adamw, sgd or lamb\n",
               name.c_str());
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  g_case = take_optimizer_flag(argc, argv);
  if (g_case == nullptr) return 2;
  const auto flags = ampx::bench::initialize(argc, argv, g_elements);
  g_elements = flags.elements;
  const std::string copy = "BM_Copy", ampx = "BM_" + g_case->bench + "AmpxBf16",
                    torch_name = "BM_" + g_case->bench + "TorchFp32";
  std::vector<std::pair<std::string, void (*)(benchmark::State&)>> benches = {{copy, BM_Copy},
                                                                              {ampx, BM_AmpxBf16}};
  if (g_case->torch) benches.emplace_back(torch_name, BM_TorchFp32);
  for (const auto& b : benches) {
    ampx::bench::timed(benchmark::RegisterBenchmark(b.first.c_str(), b.second)->Arg(1)->Arg(2),
                       flags, benchmark::kMillisecond, 1.0);
  }
  benchmark::AddCustomContext("libtorch", ampx::detail::compat::torch_version());
  benchmark::AddCustomContext("optimizer", g_case->flag);
  benchmark::AddCustomContext("masters", g_masters);
  benchmark::AddCustomContext("state", g_state);
  ampx::bench::print_header(flags,
                            "LibTorch %s, %s, %lld params; ampx: bf16 params/grads, masters %s, "
                            "moments %s (credited %lld B/element); torch: %s\n",
                            ampx::detail::compat::torch_version(), g_case->bench.c_str(),
                            static_cast<long long>(g_elements), g_masters.c_str(), g_state.c_str(),
                            static_cast<long long>(ampx_bytes_per_element()),
                            g_case->torch ? "fp32" : "none (LibTorch has no such optimizer)");
  ampx::bench::run_with_table(flags, [&](const ampx::bench::Table& table) {
    ampx::bench::print_optimizer_table(table, copy, ampx, torch_name);
  });
  return 0;
}
