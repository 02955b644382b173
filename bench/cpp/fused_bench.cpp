// ampx's fused 16-bit kernels (ampx/kernels.h) against what O2 ran before
// them, forward + backward on the main job's shapes, at 1 and 2 threads: the
// norms against their float32 composites, the GELU against LibTorch's bf16
// GELU and a copy of the bytes it moves:
//
//   build/host/bench/ampx_fused_bench [--benchmark_filter=...] [--elements=N]
//
// --elements: activations per tensor (default 32 x 256 x 256, the gpt's
// [batch, block, d]; the GELU runs 4x that, the MLP's hidden width).
//   BM_LayerNorm_ampx       ampx::mixed_layer_norm: bf16 in and out, fp32 affine
//   BM_LayerNorm_fp32_cast  cast to fp32, at::layer_norm, cast back
//   BM_BatchNorm_ampx       ampx::mixed_batch_norm, training, [N, 64, 16, 16]
//   BM_BatchNorm_fp32_cast  cast to fp32, at::batch_norm, cast back
//   BM_Gelu_ampx            ampx::mixed_gelu on bf16, forward + backward
//   BM_Gelu_aten_bf16       torch::gelu on bf16, forward + backward
//   BM_Gelu_copy            five bf16 copies of the GELU's size: the bytes its
//                           forward (x, y) and backward (x, dy, dx) move
//   BM_Attention_{bf16,fp32}_{ampx,explicit,sdpa}
//                           causal self-attention on the main job's shapes
//                           (see BM_Attention), ampx's fused kernel against
//                           gpt's explicit ops and LibTorch 2.1+'s SDPA
//   BM_Attention_bf16_ampx_avx512
//                           (CPUs with AVX512-BF16) ampx's kernel on its plain
//                           AVX-512 build: float32 products, no vdpbf16ps
//   BM_MaxPool_{ampx,aten,aten_channels_last}
//                           2 x 2 max pooling of float32 [128, 32, 28, 28] and
//                           [128, 64, 14, 14] (mnist-cnn's two pools at its
//                           batch), ampx::max_pool2d against LibTorch's on the
//                           same NCHW input and on a channels-last copy
// Each iteration runs forward and backward through autograd, as training
// does. The closing table gives each family's times against ampx's.

#include "bench_util.h"

#include "ampx/detail/compat.h"
#include "ampx/detail/cpu_isa.h"
#include "ampx/detail/kernels.h"
#include "ampx/kernels.h"
#include "ampx/memory.h"
#include "ampx/policy.h"

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>

namespace {

int64_t g_elements = int64_t{32} * 256 * 256;
constexpr int64_t kWidth = 256;
constexpr int64_t kChannels = 64;

void clear_grads(std::initializer_list<torch::Tensor> ts) {
  for (auto t : ts) t.mutable_grad() = torch::Tensor();
}

void BM_LayerNorm(benchmark::State& state, bool fused) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  const int64_t rows = g_elements / kWidth;
  const auto x = torch::randn({rows, kWidth}).to(torch::kBFloat16).requires_grad_(true);
  const auto dy = torch::randn({rows, kWidth}).to(torch::kBFloat16);
  const auto w = torch::ones({kWidth}).requires_grad_(true);
  const auto b = torch::zeros({kWidth}).requires_grad_(true);
  for (auto _ : state) {
    const auto y = fused ? ampx::mixed_layer_norm(x, {kWidth}, w, b)
                         : at::layer_norm(x.to(torch::kFloat), {kWidth}, w, b).to(torch::kBFloat16);
    y.backward(dy);
    clear_grads({x, w, b});
  }
  ampx::bench::set_traffic(state, rows * kWidth * 2 * 5, rows * kWidth, at::get_num_threads());
}

void BM_BatchNorm(benchmark::State& state, bool fused) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  const int64_t n = g_elements / (kChannels * 256);
  const auto x = torch::randn({n, kChannels, 16, 16}).to(torch::kBFloat16).requires_grad_(true);
  const auto dy = torch::randn_like(x);
  const auto w = torch::ones({kChannels}).requires_grad_(true);
  const auto b = torch::zeros({kChannels}).requires_grad_(true);
  auto mean = torch::zeros({kChannels}), var = torch::ones({kChannels});
  for (auto _ : state) {
    const auto y =
        fused ? ampx::mixed_batch_norm(x, w, b, mean, var, /*training=*/true)
              : at::batch_norm(x.to(torch::kFloat), w, b, mean, var, true, 0.1, 1e-5, false)
                    .to(torch::kBFloat16);
    y.backward(dy);
    clear_grads({x, w, b});
  }
  ampx::bench::set_traffic(state, x.numel() * 2 * 5, x.numel(), at::get_num_threads());
}

enum class Gelu { kCopy, kAten, kAmpx };

void BM_Gelu(benchmark::State& state, Gelu which) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  const int64_t n = 4 * g_elements;
  const auto x = torch::randn({n}).to(torch::kBFloat16).requires_grad_(true);
  const auto dy = torch::randn({n}).to(torch::kBFloat16);
  auto dst = torch::empty_like(dy);
  for (auto _ : state) {
    if (which == Gelu::kCopy) {  // 5 x n x 2 bytes each way over the five copies' reads and writes
      for (int i = 0; i < 5; ++i) dst.copy_(i % 2 ? dy : x.detach());
      benchmark::ClobberMemory();
    } else {
      (which == Gelu::kAmpx ? ampx::mixed_gelu(x) : torch::gelu(x)).backward(dy);
      clear_grads({x});
    }
  }
  ampx::bench::set_traffic(state, n * 2 * 5, n, at::get_num_threads());
}

enum class Attention { kAmpx, kAmpxAvx512, kExplicit, kSdpa };

// Causal self-attention as gpt's forward makes it: q, k, v views of one
// [B, T, 3, H, E] projection (B 32, T 128, H 4, E 64: the main job's), the
// heads merged after; forward and backward to the projection's gradient.
//   ampx:     ampx::scaled_dot_product_attention
//   explicit: matmul, scale, masked_fill, softmax, matmul (gpt's ops before
//             ampx's kernel; products wide where O2 makes them so)
//   sdpa:     at::scaled_dot_product_attention (LibTorch 2.1+), outside
//             ampx's guards (a WideProductsGuard would route it to ampx's
//             kernel); ampx_attention_bench compares it by shape
void BM_Attention(benchmark::State& state, Attention which, torch::ScalarType dtype) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  const int64_t B = 32, T = 128, H = 4, E = 64;
  const auto qkv = torch::randn({B, T, 3, H, E}).to(dtype).requires_grad_(true);
  const auto dy = torch::randn({B, T, H * E}).to(dtype);
  const auto hidden = torch::ones({T, T}, torch::kBool).triu(1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(E));
  std::optional<ampx::WideProductsGuard> wide;
  if (which == Attention::kExplicit) wide.emplace();
  for (auto _ : state) {
    const auto parts = qkv.permute({2, 0, 3, 1, 4}).unbind(0);
    const auto &q = parts[0], &k = parts[1], &v = parts[2];
    torch::Tensor y;
    if (which == Attention::kAmpx) {
      y = ampx::scaled_dot_product_attention(q, k, v, /*is_causal=*/true);
    } else if (which == Attention::kAmpxAvx512) {
      y = ampx::detail::cpu::scaled_dot_product_attention(q, k, v, /*is_causal=*/true, {},
                                                          ampx::detail::cpu::Isa::kAvx512);
    } else if (which == Attention::kExplicit) {
      auto att = torch::matmul(q, k.transpose(-2, -1)) * scale;
      att = torch::softmax(att.masked_fill(hidden, -INFINITY), -1);
      y = torch::matmul(att, v);
    } else {
#if AMPX_TORCH_AT_LEAST(2, 1)
      y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
#endif
    }
    y.transpose(1, 2).reshape({B, T, H * E}).backward(dy);
    clear_grads({qkv});
  }
  // Bytes: q, k, v and y forward; q, k, v, y, dy and the three gradients back.
  ampx::bench::set_traffic(state, B * T * H * E * 2 * 12, B * H * T * T, at::get_num_threads());
}

enum class MaxPool { kAmpx, kAten, kAtenChannelsLast };

void BM_MaxPool(benchmark::State& state, MaxPool which) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  torch::manual_seed(0);
  std::vector<torch::Tensor> xs, dys;
  for (const auto& sizes : {std::vector<int64_t>{128, 32, 28, 28}, {128, 64, 14, 14}}) {
    auto x = torch::relu(torch::randn(sizes));
    if (which == MaxPool::kAtenChannelsLast) x = x.contiguous(torch::MemoryFormat::ChannelsLast);
    xs.push_back(x.requires_grad_(true));
    dys.push_back(torch::randn({sizes[0], sizes[1], sizes[2] / 2, sizes[3] / 2}));
  }
  int64_t bytes = 0;
  for (auto _ : state) {
    for (size_t i = 0; i < xs.size(); ++i) {
      (which == MaxPool::kAmpx ? ampx::max_pool2d(xs[i], 2) : torch::max_pool2d(xs[i], 2))
          .backward(dys[i]);
      clear_grads({xs[i]});
    }
  }
  // Bytes: x (4 a float) and y (a quarter of x) forward, dy and dx back; the
  // saved places or indices left out.
  for (const auto& x : xs) bytes += x.numel() * 10;
  ampx::bench::set_traffic(state, bytes, xs[0].numel() + xs[1].numel(), at::get_num_threads());
}

void print_ratios(const ampx::bench::Table& table) {
  std::printf("%-8s %-24s %10s %10s\n", "threads", "benchmark", "ms", "vs first");
  for (const auto& entry : table) {
    for (const char* family : {"BM_LayerNorm", "BM_BatchNorm", "BM_Gelu", "BM_Attention_bf16",
                               "BM_Attention_fp32", "BM_MaxPool"}) {
      const std::string first = std::string(family) + "_ampx";
      const auto* base = ampx::bench::find(entry.second, first);
      for (const auto& row : entry.second) {
        if (row.first.rfind(family, 0) != 0 || base == nullptr) continue;
        std::printf("%-8s %-24s %10.2f %9.2fx\n", entry.first.c_str(), row.first.c_str(),
                    row.second.ms, row.second.ms / base->ms);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const auto flags = ampx::bench::initialize(argc, argv, g_elements);
  g_elements = flags.elements;
  // As ampx-train does: freed activations stay mapped, so the timings are
  // the kernels', not the kernel's page faults on every fresh output.
  (void)ampx::keep_freed_cpu_memory();
  const auto timed = [&](benchmark::internal::Benchmark* b) {
    ampx::bench::timed(b->Arg(1)->Arg(2), flags, benchmark::kMillisecond, 1.0);
  };
  timed(benchmark::RegisterBenchmark("BM_LayerNorm_ampx", BM_LayerNorm, true));
  timed(benchmark::RegisterBenchmark("BM_LayerNorm_fp32_cast", BM_LayerNorm, false));
  timed(benchmark::RegisterBenchmark("BM_BatchNorm_ampx", BM_BatchNorm, true));
  timed(benchmark::RegisterBenchmark("BM_BatchNorm_fp32_cast", BM_BatchNorm, false));
  timed(benchmark::RegisterBenchmark("BM_Gelu_ampx", BM_Gelu, Gelu::kAmpx));
  timed(benchmark::RegisterBenchmark("BM_Gelu_aten_bf16", BM_Gelu, Gelu::kAten));
  timed(benchmark::RegisterBenchmark("BM_Gelu_copy", BM_Gelu, Gelu::kCopy));
  for (const auto dtype : {torch::kBFloat16, torch::kFloat}) {
    const std::string family =
        std::string("BM_Attention_") + (dtype == torch::kFloat ? "fp32" : "bf16");
    timed(benchmark::RegisterBenchmark((family + "_ampx").c_str(), BM_Attention, Attention::kAmpx,
                                       dtype));
    if (dtype == torch::kBFloat16 &&
        ampx::detail::cpu::best_isa() == ampx::detail::cpu::Isa::kAvx512Bf16) {
      timed(benchmark::RegisterBenchmark((family + "_ampx_avx512").c_str(), BM_Attention,
                                         Attention::kAmpxAvx512, dtype));
    }
    timed(benchmark::RegisterBenchmark((family + "_explicit").c_str(), BM_Attention,
                                       Attention::kExplicit, dtype));
#if AMPX_TORCH_AT_LEAST(2, 1)
    timed(benchmark::RegisterBenchmark((family + "_sdpa").c_str(), BM_Attention, Attention::kSdpa,
                                       dtype));
#endif
  }
  timed(benchmark::RegisterBenchmark("BM_MaxPool_ampx", BM_MaxPool, MaxPool::kAmpx));
  timed(benchmark::RegisterBenchmark("BM_MaxPool_aten", BM_MaxPool, MaxPool::kAten));
  timed(benchmark::RegisterBenchmark("BM_MaxPool_aten_channels_last", BM_MaxPool,
                                     MaxPool::kAtenChannelsLast));
  benchmark::AddCustomContext("libtorch", ampx::detail::compat::torch_version());
  ampx::bench::print_header(flags, "LibTorch %s, %lld bf16 activations per norm tensor\n",
                            ampx::detail::compat::torch_version(),
                            static_cast<long long>(g_elements));
  ampx::bench::run_with_table(flags, print_ratios);
  return 0;
}
