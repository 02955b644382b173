// The matrix-product peaks MFU is measured against: achieved FLOP/s of
// square torch::mm products in fp32, bf16 and fp16 on this machine, at the
// thread count a training run uses. Not a Google Benchmark: one plain run a
// script can call before a training job and read back as JSON.
//
//   build/host/bench/ampx_gemm_peak [--threads N] [--sizes 1024,2048,4096]
//       [--dtypes fp32,bf16,fp16] [--reps R] [--max-seconds S] [--json FILE]
//
// Per dtype and size n: C = A B with A, B contiguous n x n (randn), written
// into a preallocated C (at::mm_out: no allocation in the timing), warmed
// up, then the median of R timed products; 2 n^3 / median is its FLOP/s.
// The best size is the dtype's peak. A dtype this LibTorch cannot multiply
// on the CPU is reported as null; a size whose predicted time (from the
// previous size, x (n / n_prev)^3) exceeds --max-seconds is skipped and
// listed, so a slow fallback path (e.g. fp16 without a CPU kernel that
// vectorizes it) cannot stall the script. --json FILE writes:
//
//   {"threads": 2, "torch_version": "2.6.0", "cpu": "...",
//    "blas": "OpenBLAS (openmp)", "mkldnn": true, "reps": 5,
//    "fp32_peak_gflops": 140.1, "bf16_peak_gflops": 210.3, "fp16_peak_gflops": null,
//    "results": [{"dtype": "fp32", "m": 1024, "n": 1024, "k": 1024,
//                 "gflops": 120.5, "ms": 17.8}, ...],
//    "skipped": [{"dtype": "fp16", "m": 4096, "n": 4096, "k": 4096, "reason": "..."}]}
//
// "blas" is the OpenBLAS build fp32 products went to (ampx-train prints the
// same string): run with LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-openmp
// as `make bench` does, or fp32 fights OpenMP for the cores.

#include "machine.h"

#include "ampx/version.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Options {
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int64_t> sizes = {1024, 2048, 4096};
  std::vector<std::string> dtypes = {"fp32", "bf16", "fp16"};
  int reps = 5;
  double max_seconds = 30;
  std::string json;
};

struct Measurement {
  std::string dtype;
  int64_t n = 0;
  double ms = 0;
  double gflops = 0;
};

struct Skip {
  std::string dtype;
  int64_t n = 0;
  std::string reason;
};

torch::ScalarType scalar_type(const std::string& dtype) {
  if (dtype == "fp32") return torch::kFloat;
  if (dtype == "bf16") return torch::kBFloat16;
  if (dtype == "fp16") return torch::kHalf;
  throw std::invalid_argument("unknown dtype '" + dtype + "' (fp32, bf16, fp16)");
}

template <class T>
std::vector<T> split(const std::string& list, T (*parse)(const std::string&)) {
  std::vector<T> out;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(parse(item));
  }
  return out;
}

int64_t parse_int(const std::string& s) {
  return std::stoll(s);
}
std::string parse_string(const std::string& s) {
  return s;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--threads") {
      o.threads = std::stoi(value);
    } else if (flag == "--sizes") {
      o.sizes = split<int64_t>(value, parse_int);
    } else if (flag == "--dtypes") {
      o.dtypes = split<std::string>(value, parse_string);
    } else if (flag == "--reps") {
      o.reps = std::stoi(value);
    } else if (flag == "--max-seconds") {
      o.max_seconds = std::stod(value);
    } else if (flag == "--json") {
      o.json = value;
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  if (o.threads < 1 || o.reps < 1 || o.sizes.empty() || o.max_seconds <= 0) {
    throw std::invalid_argument(
        "--threads, --reps and --max-seconds must be positive, --sizes set");
  }
  for (const auto& d : o.dtypes) scalar_type(d);
  std::sort(o.sizes.begin(), o.sizes.end());  // predictions go from small to large
  return o;
}

double seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Whether this LibTorch multiplies `dtype` on the CPU at all ("" if so).
std::string unsupported(torch::ScalarType dtype) {
  try {
    auto a = torch::ones({8, 8}, dtype);
    (void)torch::mm(a, a);
    return "";
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    return what.substr(0, what.find('\n'));
  }
}

// Every size of one dtype, smallest first, until the next would exceed the budget.
void measure(const std::string& name, const Options& o, std::vector<Measurement>& results,
             std::vector<Skip>& skipped) {
  const auto dtype = scalar_type(name);
  double prev_s = 0;  // median seconds of the previous size
  int64_t prev_n = 0;
  for (const int64_t n : o.sizes) {
    if (prev_n > 0) {
      const double ratio = static_cast<double>(n) / prev_n;
      const double predicted = prev_s * ratio * ratio * ratio * (o.reps + 1);
      if (predicted > o.max_seconds) {
        char reason[96];
        std::snprintf(reason, sizeof(reason), "predicted %.0f s > --max-seconds %.0f", predicted,
                      o.max_seconds);
        skipped.push_back({name, n, reason});
        continue;  // larger sizes are skipped by the same prediction
      }
    }
    auto a = torch::randn({n, n}).to(dtype);
    auto b = torch::randn({n, n}).to(dtype);
    auto c = torch::empty({n, n}, dtype);
    const auto product = [&] { at::mm_out(c, a, b); };
    const double first = seconds_of(product);  // warm-up: packing buffers, thread pool
    int reps = o.reps;
    if (first * (reps + 1) > o.max_seconds) {
      reps = std::max(1, static_cast<int>(o.max_seconds / first) - 1);
    } else if (first < 1.0) {
      product();  // a second warm-up where it is cheap
    }
    std::vector<double> times;
    for (int r = 0; r < reps; ++r) times.push_back(seconds_of(product));
    std::sort(times.begin(), times.end());
    const double median = times.size() % 2
                              ? times[times.size() / 2]
                              : 0.5 * (times[times.size() / 2 - 1] + times[times.size() / 2]);
    Measurement m{name, n, median * 1e3, 2.0 * n * n * n / median / 1e9};
    std::printf("%-6s %6lld %10.2f %10.1f %6d\n", name.c_str(), static_cast<long long>(n), m.ms,
                m.gflops, reps);
    std::fflush(stdout);
    results.push_back(m);
    prev_s = median;
    prev_n = n;
  }
}

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += ' ';
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

std::string number_or_null(const std::map<std::string, double>& peaks, const std::string& d) {
  const auto it = peaks.find(d);
  if (it == peaks.end()) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f", it->second);
  return buf;
}

void write_json(const std::string& path, const Options& o,
                const std::map<std::string, double>& peaks, const std::vector<Measurement>& results,
                const std::vector<Skip>& skipped) {
  std::ofstream out(path);
  TORCH_CHECK(out, "ampx_gemm_peak: cannot write ", path);
  out << "{\n  \"threads\": " << o.threads
      << ",\n  \"torch_version\": " << quoted(ampx::torch_version())
      << ",\n  \"cpu\": " << quoted(ampx::train::cpu_model())
      << ",\n  \"blas\": " << quoted(ampx::train::blas_library())
      << ",\n  \"mkldnn\": " << (at::hasMKLDNN() ? "true" : "false") << ",\n  \"reps\": " << o.reps
      << ",\n  \"fp32_peak_gflops\": " << number_or_null(peaks, "fp32")
      << ",\n  \"bf16_peak_gflops\": " << number_or_null(peaks, "bf16")
      << ",\n  \"fp16_peak_gflops\": " << number_or_null(peaks, "fp16") << ",\n  \"results\": [";
  char buf[256];
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    const auto n = static_cast<long long>(r.n);
    std::snprintf(buf, sizeof(buf),
                  "%s\n    {\"dtype\": \"%s\", \"m\": %lld, \"n\": %lld, \"k\": %lld, "
                  "\"gflops\": %.3f, \"ms\": %.4f}",
                  i ? "," : "", r.dtype.c_str(), n, n, n, r.gflops, r.ms);
    out << buf;
  }
  out << "\n  ],\n  \"skipped\": [";
  for (size_t i = 0; i < skipped.size(); ++i) {
    const auto& s = skipped[i];
    const auto n = static_cast<long long>(s.n);
    std::snprintf(buf, sizeof(buf),
                  "%s\n    {\"dtype\": \"%s\", \"m\": %lld, \"n\": %lld, \"k\": %lld, \"reason\": ",
                  i ? "," : "", s.dtype.c_str(), n, n, n);
    out << buf << quoted(s.reason) << "}";
  }
  out << "\n  ]\n}\n";
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ampx_gemm_peak: %s\n", e.what());
    return 2;
  }
  at::set_num_threads(o.threads);
  torch::manual_seed(0);
  std::printf("LibTorch %s, %d threads, %s, BLAS: %s, oneDNN: %s\n", ampx::torch_version(),
              o.threads, ampx::train::cpu_model().c_str(), ampx::train::blas_library().c_str(),
              at::hasMKLDNN() ? "yes" : "no");
  if (const auto warning = ampx::train::blas_warning(o.threads); !warning.empty()) {
    std::printf("%s\n", warning.c_str());
  }
  std::printf("%-6s %6s %10s %10s %6s\n", "dtype", "n", "ms", "GFLOP/s", "reps");

  std::vector<Measurement> results;
  std::vector<Skip> skipped;
  std::map<std::string, double> peaks;
  for (const auto& name : o.dtypes) {
    if (const auto why = unsupported(scalar_type(name)); !why.empty()) {
      std::printf("%-6s unsupported on this CPU build: %s\n", name.c_str(), why.c_str());
      for (const auto n : o.sizes) skipped.push_back({name, n, "unsupported: " + why});
      continue;
    }
    measure(name, o, results, skipped);
    for (const auto& r : results) {
      if (r.dtype == name) peaks[name] = std::max(peaks[name], r.gflops);
    }
  }
  for (const auto& s : skipped) {
    if (s.reason.rfind("unsupported", 0) != 0) {
      std::printf("skipped %s n=%lld: %s\n", s.dtype.c_str(), static_cast<long long>(s.n),
                  s.reason.c_str());
    }
  }
  std::printf("\n%-6s %14s\n", "dtype", "peak GFLOP/s");
  for (const auto& name : o.dtypes) {
    std::printf("%-6s %14s\n", name.c_str(), number_or_null(peaks, name).c_str());
  }
  if (!o.json.empty()) {
    write_json(o.json, o, peaks, results, skipped);
    std::printf("wrote %s\n", o.json.c_str());
  }
  return 0;
}
