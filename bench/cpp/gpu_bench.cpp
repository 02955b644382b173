// What only a GPU can say, as JSON (not a Google Benchmark; the device
// command scripts/device-run.sh runs it):
//
//   peaks      square matrix products (n = 4096, 8192) in fp32, fp32 with
//              TF32, bf16 and fp16: MFU's denominators, measured in the same
//              call as the training runs they divide.
//   optimizer  one AdamW step over GPT-2 small's 148 parameter tensors
//              (124.4M elements):
//                ampx      bf16 params and grads, fp32 masters and moments:
//                          the fused multi-tensor step (src/optim/fused/), which
//                          also writes the bf16 params; credited 30 B/element
//                torch     at::_fused_adamw_ (LibTorch 2.1+; Python's
//                          AdamW(fused=True)) on fp32 params and grads, then
//                          the copy of the result into bf16 params: what the
//                          same O2 step costs with PyTorch's kernels
//                          (34 B/element moved)
//                copy      a device copy of 15 B/element (30 moved): the
//                          bandwidth ampx's step is held against
//              all three unscale by a device scale and read a device
//              found-inf flag, as a GradScaler step does.
//
//   ampx_gpu_bench [--out FILE] [--iters N]
//
// Without a CUDA device it writes {"skipped": "..."} and exits 0, so that the
// device command's rehearsal on the CPU runs it too.

#include "ampx/detail/compat.h"
#include "ampx/optim.h"

#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

/// Median milliseconds of `iters` calls of `fn` after 3 untimed ones, each
/// ended by a device synchronisation.
double median_ms(int iters, const std::function<void()>& fn) {
  for (int i = 0; i < 3; ++i) fn();
  torch::cuda::synchronize();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    fn();
    torch::cuda::synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

nlohmann::json peaks(int iters) {
  nlohmann::json out = nlohmann::json::array();
  auto& ctx = at::globalContext();
  const bool tf32_before = ctx.allowTF32CuBLAS();
  struct Kind {
    const char* name;
    torch::ScalarType dtype;
    bool tf32;
  };
  for (const Kind k : {Kind{"fp32", torch::kFloat, false}, Kind{"tf32", torch::kFloat, true},
                       Kind{"bf16", torch::kBFloat16, false}, Kind{"fp16", torch::kHalf, false}}) {
    ctx.setAllowTF32CuBLAS(k.tf32);
    for (int64_t n : {4096, 8192}) {
      const auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(k.dtype);
      const auto a = torch::randn({n, n}, opts), b = torch::randn({n, n}, opts);
      auto c = torch::empty({n, n}, opts);
      const double ms = median_ms(iters, [&] { at::mm_out(c, a, b); });
      out.push_back({{"kind", k.name},
                     {"n", n},
                     {"ms", ms},
                     {"tflops", 2.0 * n * n * n / (ms * 1e-3) / 1e12}});
    }
  }
  ctx.setAllowTF32CuBLAS(tf32_before);
  return out;
}

/// GPT-2 small's parameter shapes (wte, wpe, 12 blocks, ln_f).
std::vector<std::vector<int64_t>> gpt2_small_shapes() {
  std::vector<std::vector<int64_t>> s = {{50257, 768}, {1024, 768}};
  for (int l = 0; l < 12; ++l) {
    for (const auto& shape : std::vector<std::vector<int64_t>>{{768},
                                                               {768},
                                                               {2304, 768},
                                                               {2304},
                                                               {768, 768},
                                                               {768},
                                                               {768},
                                                               {768},
                                                               {3072, 768},
                                                               {3072},
                                                               {768, 3072},
                                                               {768}}) {
      s.push_back(shape);
    }
  }
  s.push_back({768});
  s.push_back({768});
  return s;
}

nlohmann::json optimizer(int iters) {
  const auto shapes = gpt2_small_shapes();
  int64_t elements = 0;
  for (const auto& s : shapes) elements += c10::multiply_integers(s);
  const auto dev = torch::TensorOptions().device(torch::kCUDA);
  const auto scale = torch::full({}, 65536.f, dev), found_inf = torch::zeros({}, dev);
  constexpr double kLr = 1e-4, kB1 = 0.9, kB2 = 0.999, kWd = 0.01, kEps = 1e-8;
  nlohmann::json out = {{"tensors", shapes.size()}, {"elements", elements}};
  auto record = [&](const char* name, double ms, double bytes_per_element) {
    const double gbs = bytes_per_element * static_cast<double>(elements) / (ms * 1e-3) / 1e9;
    out[name] = {{"ms", ms}, {"bytes_per_element", bytes_per_element}, {"gb_per_s", gbs}};
  };

  {  // ampx: bf16 params and grads, fp32 masters and moments
    std::vector<torch::Tensor> params;
    for (const auto& s : shapes) {
      auto p = (torch::randn(s, dev) * 0.02).to(torch::kBFloat16).requires_grad_();
      p.mutable_grad() = (torch::randn(s, dev) * 1e-3 * 65536).to(torch::kBFloat16);
      params.push_back(p);
    }
    ampx::optim::AdamW opt(
        params, ampx::optim::AdamWOptions(kLr).betas({kB1, kB2}).eps(kEps).weight_decay(kWd));
    record("ampx", median_ms(iters, [&] { opt.step_scaled(scale, found_inf); }), 30);
  }
  {  // a copy of the same bytes
    const auto src = torch::randn({elements * 15 / 4}, dev);
    auto dst = torch::empty_like(src);
    record("copy", median_ms(iters, [&] { dst.copy_(src); }), 30);
  }
#if AMPX_TORCH_AT_LEAST(2, 1)
  {  // PyTorch's fused AdamW on fp32 params and grads, then the bf16 copy
    std::vector<torch::Tensor> p32, g32, m, v, steps, p16;
    for (const auto& s : shapes) {
      p32.push_back(torch::randn(s, dev) * 0.02);
      g32.push_back(torch::randn(s, dev) * 1e-3 * 65536);
      m.push_back(torch::zeros(s, dev));
      v.push_back(torch::zeros(s, dev));
      steps.push_back(torch::zeros({}, dev));
      p16.push_back(p32.back().to(torch::kBFloat16));
    }
    const double ms = median_ms(iters, [&] {
      at::_fused_adamw_(p32, g32, m, v, {}, steps, kLr, kB1, kB2, kWd, kEps, false, false, scale,
                        found_inf);
#if AMPX_TORCH_AT_LEAST(2, 3)
      at::_foreach_copy_(p16, p32);
#else
      for (size_t i = 0; i < p16.size(); ++i) p16[i].copy_(p32[i]);
#endif
    });
    record("torch_fused_adamw_plus_copy", ms, 34);
    out["ampx_speedup_vs_torch"] = ms / out["ampx"]["ms"].get<double>();
  }
#else
  out["torch_fused_adamw_plus_copy"] = {{"skipped", "LibTorch before 2.1 has no _fused_adamw_"}};
#endif
  out["ampx_fraction_of_copy_bandwidth"] =
      out["ampx"]["gb_per_s"].get<double>() / out["copy"]["gb_per_s"].get<double>();
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path;
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) {
      out_path = argv[++i];
    } else if (a == "--iters" && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: ampx_gpu_bench [--out FILE] [--iters N]\n");
      return 2;
    }
  }
  nlohmann::json result = {{"tool", "ampx_gpu_bench"},
                           {"libtorch", ampx::detail::compat::torch_version()}};
  if (!torch::cuda::is_available()) {
    result["skipped"] = "no CUDA device";
  } else {
    torch::manual_seed(0);
    result["peaks"] = peaks(iters);
    result["optimizer"] = optimizer(iters);
  }
  const std::string text = result.dump(2);
  std::cout << text << "\n";
  if (!out_path.empty()) {
    std::ofstream f(out_path);
    f << text << "\n";
    if (!f) {
      std::fprintf(stderr, "ampx_gpu_bench: cannot write --out %s\n", out_path.c_str());
      return 1;
    }
  }
  return 0;
}
