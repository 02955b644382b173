#include "machine.h"

#include <fstream>

namespace ampx::train {

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

std::string blas_library() {
  std::ifstream maps("/proc/self/maps");
  bool openblas = false;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("openblas-openmp/") != std::string::npos) return "OpenBLAS (openmp)";
    if (line.find("openblas-pthread/") != std::string::npos) return "OpenBLAS (pthread)";
    openblas = openblas || line.find("libopenblas") != std::string::npos;
  }
  return openblas ? "OpenBLAS" : "other BLAS";
}

std::string blas_warning(int threads) {
  if (threads < 2 || blas_library() != "OpenBLAS (pthread)") return {};
  return "note: OpenBLAS is its pthreads build, whose threads compete with LibTorch's spinning "
         "OpenMP threads: fp32 matrix products run about 2x slower than with the OpenMP build "
         "(Debian: libopenblas0-openmp). Run with "
         "LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-openmp, as `make run` does, "
         "for a fair fp32 baseline.";
}

}  // namespace ampx::train
