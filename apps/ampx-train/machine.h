#pragma once

// What the numbers of a run depend on besides ampx: the CPU and the BLAS
// build LibTorch's fp32 matrix products went to.

#include <string>

namespace ampx::train {

/// /proc/cpuinfo's "model name", or "unknown CPU".
std::string cpu_model();

/// The OpenBLAS build mapped into this process: "OpenBLAS (openmp)",
/// "OpenBLAS (pthread)", "OpenBLAS", or "other BLAS".
std::string blas_library();

/// A warning when the BLAS build is known to slow fp32 down here (empty
/// otherwise): OpenBLAS's pthreads build with more than one thread competes
/// for the cores with LibTorch's spinning OpenMP threads.
std::string blas_warning(int threads);

}  // namespace ampx::train
