#include "machine.h"

#include "ampx/kernels.h"

#include <ATen/Context.h>
#include <ATen/Version.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

namespace ampx::train {
namespace {

namespace fs = std::filesystem;

/// The file of the OpenBLAS library mapped into this process, as the kernel
/// resolved it (Debian: .../openblas-pthread/libopenblasp-r0.3.21.so), or "".
std::string mapped_openblas() {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    const auto path = line.find('/');
    if (path != std::string::npos && line.find("libopenblas", path) != std::string::npos) {
      return line.substr(path);
    }
  }
  return {};
}

/// "MKL 2024.2" when LibTorch was built with MKL as its BLAS (PyTorch's
/// wheels link it in: no library of its own is mapped), else "".
std::string builtin_mkl() {
  if (!at::hasMKL()) return {};
  const std::string config = at::show_config();
  const std::string key = "Math Kernel Library Version ";
  const auto pos = config.find(key);
  if (pos == std::string::npos) return "MKL";
  const auto begin = pos + key.size();
  const auto end = config.find_first_not_of("0123456789.", begin);
  return "MKL " + config.substr(begin, end - begin);
}

bool env_is(const char* name, const std::string& value) {
  const char* v = std::getenv(name);
  return v != nullptr && value == v;
}

}  // namespace

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

std::string blas_library() {
  const std::string lib = mapped_openblas();
  if (lib.empty()) {
    const std::string mkl = builtin_mkl();
    return mkl.empty() ? "other BLAS" : mkl + " (in LibTorch)";
  }
  if (lib.find("openblas-openmp/") != std::string::npos) return "OpenBLAS (openmp)";
  if (lib.find("openblas-pthread/") != std::string::npos) return "OpenBLAS (pthread)";
  return "OpenBLAS";
}

std::string openblas_openmp_dir() {
  const fs::path lib = mapped_openblas();
  if (lib.empty()) return {};
  // <multiarch>/openblas-pthread/libopenblasp-r0.3.21.so -> <multiarch>/openblas-openmp
  const fs::path dir = lib.parent_path().parent_path() / "openblas-openmp";
  std::error_code ec;
  return fs::exists(dir / "libopenblas.so.0", ec) ? dir.string() : std::string();
}

std::string blas_dir_to_switch_to() {
  if (env_is(kBlasChoiceEnv, "keep") || std::getenv(kBlasSwitchedEnv) != nullptr) return {};
  if (blas_library() != "OpenBLAS (pthread)") return {};
  return openblas_openmp_dir();
}

std::string blas_setting() {
  const std::string lib = blas_library();
  if (std::getenv(kBlasSwitchedEnv) != nullptr && lib == "OpenBLAS (openmp)") {
    return lib + ", chosen over the pthreads build (" + kBlasChoiceEnv + "=keep: keep it)";
  }
  if (env_is(kBlasChoiceEnv, "keep")) return lib + " (" + kBlasChoiceEnv + "=keep)";
  return lib;
}

std::string cpu_products_setting(c10::ScalarType dtype) {
  const std::string name = dtype == c10::kHalf ? "fp16" : "bf16";
  const auto mode = ampx::get_cpu_products();
  const std::string env = std::string("AMPX_CPU_PRODUCTS=") + ampx::to_string(mode);
  const bool wide = ampx::cpu_products_are_wide(dtype);
  const std::string path =
      wide ? "float32 BLAS, rounded once to " + name : "LibTorch's (oneDNN)";
  const std::string no_kernels = ": no vectorized " + name +
                                 " product in LibTorch here (a scalar loop without AVX-512, "
                                 "about 30x slower than fp32; for fp16 none on LibTorch 1.13)";
  if (mode != ampx::CpuProducts::kAuto) {
    if (!wide && !ampx::cpu_has_native_products(dtype)) {
      return "LibTorch's" + no_kernels + " (" + env +
             "; auto routes them through the float32 BLAS)";
    }
    return path + " (" + env + ")";
  }
  // Auto: what it measured, and the switch to the other path.
  const auto& probe = ampx::cpu_products_probe(dtype);
  const std::string other = std::string(" (AMPX_CPU_PRODUCTS=") + (wide ? "native" : "wide") +
                            " for the other path)";
  if (!probe.native_kernels) return path + no_kernels + other;
  std::ostringstream rates;
  rates << std::fixed << std::setprecision(0) << ": LibTorch's " << name << " products ran at "
        << probe.native_gflops << " GFLOP/s here, float32's at " << probe.float32_gflops;
  return path + rates.str() + other;
}

std::string cpu_products_used(c10::ScalarType dtype) {
  const bool timed = ampx::get_cpu_products() == ampx::CpuProducts::kAuto &&
                     ampx::cpu_products_probe(dtype).native_kernels;
  return std::string(ampx::cpu_products_are_wide(dtype) ? "wide" : "native") +
         (timed ? " (timed)" : "");
}

std::string cpu_products_for_children(const std::vector<c10::ScalarType>& dtypes) {
  if (ampx::get_cpu_products() != ampx::CpuProducts::kAuto || dtypes.empty()) return {};
  const bool wide = ampx::cpu_products_are_wide(dtypes.front());
  for (const auto dtype : dtypes) {
    if (ampx::cpu_products_are_wide(dtype) != wide) return {};
  }
  return wide ? "wide" : "native";
}

std::string blas_warning(int threads) {
  if (threads < 2 || blas_library() != "OpenBLAS (pthread)") return {};
  return std::string(
             "note: OpenBLAS is its pthreads build, whose threads compete with "
             "LibTorch's spinning OpenMP threads: fp32 matrix products run about 2x "
             "slower than with the OpenMP build. ") +
         (openblas_openmp_dir().empty()
              ? "Install it (Debian: libopenblas0-openmp) for a fair fp32 baseline; ampx-train "
                "then uses it."
              : std::string("It is installed: run without ") + kBlasChoiceEnv +
                    "=keep for a fair fp32 baseline.");
}

}  // namespace ampx::train
