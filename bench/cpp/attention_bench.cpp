// Causal self-attention by shape: ampx's fused kernel against LibTorch's own
// at::scaled_dot_product_attention (LibTorch 2.1+) and the explicit ops
// (matmul, scale, masked_fill, softmax, matmul), forward and backward, in
// interleaved rounds, as JSON and a table:
//
//   build/host/bench/ampx_attention_bench [--threads N] [--rounds R] [--reps K]
//       [--dtypes bf16,fp32] [--json FILE]
//
// Every shape has 4096 tokens (batch x context) and a model width of 256
// (heads x head size): the context runs 128..1024 and the head size 32..128,
// so a row's cost differs from its neighbours' only in the attention's shape.
// Each timing is one forward and backward through autograd to the
// projection's gradient, q, k and v being views of one [B, T, 3, H, E]
// tensor as a GPT makes them. Each round times every (shape, path) once
// (one warm-up call, then the median of --reps calls); a path's time is the
// median over the rounds. The SDPA row runs outside ampx's mixed-precision
// guards, which would route it to ampx's kernel; the explicit row runs
// inside WideProductsGuard, as O2 does. The first round also checks that the
// three paths agree (largest difference of the projection's gradient).

#include "ampx/detail/compat.h"
#include "ampx/kernels.h"
#include "ampx/memory.h"
#include "ampx/policy.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

enum class Path { kAmpx, kSdpa, kExplicit };

const char* path_name(Path path) {
  switch (path) {
    case Path::kAmpx:
      return "ampx";
    case Path::kSdpa:
      return "sdpa";
    case Path::kExplicit:
      return "explicit";
  }
  return "?";
}

struct Shape {
  int64_t batch, context, heads, head_size;
};

// 4096 tokens, width 256.
const std::vector<Shape> kShapes = {
    {32, 128, 8, 32}, {32, 128, 4, 64}, {32, 128, 2, 128},  //
    {16, 256, 8, 32}, {16, 256, 4, 64}, {16, 256, 2, 128},  //
    {8, 512, 8, 32},  {8, 512, 4, 64},  {8, 512, 2, 128},   //
    {4, 1024, 8, 32}, {4, 1024, 4, 64}, {4, 1024, 2, 128},
};

struct Options {
  int threads = 2;
  int rounds = 3;
  int reps = 5;
  std::vector<torch::ScalarType> dtypes = {torch::kBFloat16, torch::kFloat};
  std::string json;
};

[[noreturn]] void usage_error(const std::string& what) {
  std::fprintf(stderr,
               "ampx_attention_bench: %s\nusage: ampx_attention_bench [--threads N] [--rounds R] "
               "[--reps K] [--dtypes bf16,fp32] [--json FILE]\n",
               what.c_str());
  std::exit(2);
}

int positive(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  const long n = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || n < 1 || n > 1000) {
    usage_error(flag + " wants a whole number from 1 to 1000, got '" + value + "'");
  }
  return static_cast<int>(n);
}

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) usage_error(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--threads") {
      options.threads = positive(flag, value);
    } else if (flag == "--rounds") {
      options.rounds = positive(flag, value);
    } else if (flag == "--reps") {
      options.reps = positive(flag, value);
    } else if (flag == "--json") {
      options.json = value;
    } else if (flag == "--dtypes") {
      options.dtypes.clear();
      std::stringstream list(value);
      for (std::string item; std::getline(list, item, ',');) {
        if (item == "bf16") {
          options.dtypes.push_back(torch::kBFloat16);
        } else if (item == "fp32") {
          options.dtypes.push_back(torch::kFloat);
        } else {
          usage_error("--dtypes takes bf16 and fp32, got '" + item + "'");
        }
      }
      if (options.dtypes.empty()) usage_error("--dtypes is empty");
    } else {
      usage_error("unknown flag '" + flag + "'");
    }
  }
  return options;
}

std::vector<Path> paths() {
#if AMPX_TORCH_AT_LEAST(2, 1)
  return {Path::kAmpx, Path::kSdpa, Path::kExplicit};
#else
  return {Path::kAmpx, Path::kExplicit};
#endif
}

// One forward and backward; returns the projection's gradient.
torch::Tensor step(Path path, const Shape& s, const torch::Tensor& qkv, const torch::Tensor& dy) {
  const auto parts = qkv.permute({2, 0, 3, 1, 4}).unbind(0);
  const auto &q = parts[0], &k = parts[1], &v = parts[2];
  torch::Tensor y;
  if (path == Path::kAmpx) {
    y = ampx::scaled_dot_product_attention(q, k, v, /*is_causal=*/true);
  } else if (path == Path::kExplicit) {
    ampx::WideProductsGuard wide;
    const auto hidden =
        torch::ones({s.context, s.context}, torch::TensorOptions(torch::kBool)).triu(1);
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_size));
    auto att = torch::matmul(q, k.transpose(-2, -1)) * scale;
    att = torch::softmax(att.masked_fill(hidden, -INFINITY), -1);
    y = torch::matmul(att, v);
  } else {
#if AMPX_TORCH_AT_LEAST(2, 1)
    y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
#endif
  }
  y.transpose(1, 2).reshape({s.batch, s.context, s.heads * s.head_size}).backward(dy);
  auto grad = qkv.grad();
  qkv.mutable_grad() = torch::Tensor();
  return grad;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Which backend LibTorch's SDPA picks for these inputs (math, flash, ...).
std::string sdpa_backend(const torch::Tensor& qkv) {
#if AMPX_TORCH_AT_LEAST(2, 1)
  const auto parts = qkv.permute({2, 0, 3, 1, 4}).unbind(0);
  const int64_t choice = at::_fused_sdp_choice(parts[0], parts[1], parts[2], {}, 0.0, true);
  switch (choice) {
    case 0:
      return "math";
    case 1:
      return "flash";
    case 2:
      return "efficient";
    default:
      return "backend " + std::to_string(choice);
  }
#else
  (void)qkv;
  return "-";
#endif
}

// One shape in one dtype, its inputs and what each path measured on it.
struct Case {
  Shape shape;
  torch::ScalarType dtype;
  torch::Tensor qkv, dy;
  std::vector<std::vector<double>> ms;  // per path, one entry per round
  std::vector<double> max_diff;         // per path, against ampx, first round
  std::string backend;
};

/// Every shape in every dtype of `options`, with seeded inputs and no timings yet.
std::vector<Case> make_cases(const Options& options, const std::vector<Path>& all_paths) {
  std::vector<Case> cases;
  for (const auto dtype : options.dtypes) {
    for (const auto& s : kShapes) {
      torch::manual_seed(0);
      Case c{s, dtype, {}, {}, {}, {}, {}};
      c.qkv = torch::randn({s.batch, s.context, 3, s.heads, s.head_size})
                  .to(dtype)
                  .requires_grad_(true);
      c.dy = torch::randn({s.batch, s.context, s.heads * s.head_size}).to(dtype);
      c.ms.assign(all_paths.size(), {});
      c.max_diff.assign(all_paths.size(), 0.0);
      c.backend = sdpa_backend(c.qkv);
      cases.push_back(std::move(c));
    }
  }
  return cases;
}

/// One round: each path on each case, warmed up, its median step time added to
/// the case (and, in round 0, its gradient's largest difference from ampx's).
void time_round(const Options& options, const std::vector<Path>& all_paths, int round,
                std::vector<Case>& cases) {
  for (auto& c : cases) {
    torch::Tensor reference;
    for (size_t p = 0; p < all_paths.size(); ++p) {
      const auto grad = step(all_paths[p], c.shape, c.qkv, c.dy);  // warm-up
      if (round == 0) {
        if (p == 0) reference = grad.to(torch::kFloat);
        c.max_diff[p] = (grad.to(torch::kFloat) - reference).abs().max().item<double>();
      }
      std::vector<double> times;
      for (int r = 0; r < options.reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        step(all_paths[p], c.shape, c.qkv, c.dy);
        times.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count());
      }
      c.ms[p].push_back(median(times));
    }
  }
}

/// Prints the table of the cases' median times and returns them as --json's document.
nlohmann::json report(const Options& options, const std::vector<Path>& all_paths,
                      const std::vector<Case>& cases) {
  nlohmann::json out;
  out["libtorch"] = ampx::detail::compat::torch_version();
  out["threads"] = options.threads;
  out["rounds"] = options.rounds;
  out["reps"] = options.reps;
  out["cases"] = nlohmann::json::array();
  std::printf("LibTorch %s, %d threads, causal, forward + backward, median of %d rounds x %d\n",
              ampx::detail::compat::torch_version(), options.threads, options.rounds, options.reps);
  std::printf("%-5s %5s %5s %4s %4s %-9s", "dtype", "B", "T", "H", "E", "sdpa via");
  for (const auto path : all_paths) std::printf(" %10s", path_name(path));
  for (size_t p = 1; p < all_paths.size(); ++p) std::printf(" %9s/ampx", path_name(all_paths[p]));
  std::printf("\n");
  for (const auto& c : cases) {
    const char* dtype = c.dtype == torch::kFloat ? "fp32" : "bf16";
    nlohmann::json row = {
        {"dtype", dtype},         {"batch", c.shape.batch},         {"context", c.shape.context},
        {"heads", c.shape.heads}, {"head_size", c.shape.head_size}, {"sdpa_backend", c.backend}};
    std::printf("%-5s %5lld %5lld %4lld %4lld %-9s", dtype, static_cast<long long>(c.shape.batch),
                static_cast<long long>(c.shape.context), static_cast<long long>(c.shape.heads),
                static_cast<long long>(c.shape.head_size), c.backend.c_str());
    std::vector<double> ms;
    for (size_t p = 0; p < all_paths.size(); ++p) {
      ms.push_back(median(c.ms[p]));
      row[path_name(all_paths[p])] = {
          {"ms", ms.back()}, {"rounds_ms", c.ms[p]}, {"max_grad_diff_vs_ampx", c.max_diff[p]}};
      std::printf(" %10.2f", ms.back());
    }
    for (size_t p = 1; p < all_paths.size(); ++p) std::printf(" %13.2fx", ms[p] / ms[0]);
    std::printf("\n");
    out["cases"].push_back(row);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse(argc, argv);
  at::set_num_threads(options.threads);
  // As ampx-train does: freed activations stay mapped.
  (void)ampx::keep_freed_cpu_memory();
  const auto all_paths = paths();

  std::vector<Case> cases = make_cases(options, all_paths);
  for (int round = 0; round < options.rounds; ++round) {
    time_round(options, all_paths, round, cases);
    std::fprintf(stderr, "ampx_attention_bench: round %d of %d done\n", round + 1, options.rounds);
  }

  const nlohmann::json out = report(options, all_paths, cases);
  if (!options.json.empty()) {
    std::ofstream file(options.json);
    file << out.dump(2) << "\n";
    if (!file) {
      std::fprintf(stderr, "ampx_attention_bench: could not write --json '%s'\n",
                   options.json.c_str());
      return 1;
    }
  }
  return 0;
}
