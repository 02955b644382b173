#pragma once

// What the numbers of a run depend on besides ampx: the CPU and the BLAS
// build LibTorch's fp32 matrix products went to, and ampx-train's choice of
// that build (OpenBLAS's OpenMP build over its pthreads build when both are
// installed; see blas_dir_to_switch_to()).

#include <c10/core/ScalarType.h>

#include <string>
#include <vector>

namespace ampx::train {

/// AMPX_TRAIN_BLAS=keep: train on whichever OpenBLAS build the loader found.
inline constexpr char kBlasChoiceEnv[] = "AMPX_TRAIN_BLAS";
/// Set by ampx-train on the process it re-executed with the OpenMP build
/// (and inherited by the processes that one starts): that build was chosen,
/// and no second re-execution is tried.
inline constexpr char kBlasSwitchedEnv[] = "AMPX_TRAIN_BLAS_SWITCHED";

/// /proc/cpuinfo's "model name", or "unknown CPU".
std::string cpu_model();

/// The BLAS of this process's fp32 products: the OpenBLAS build mapped into
/// it, "OpenBLAS (openmp)", "OpenBLAS (pthread)" or "OpenBLAS"; else the MKL
/// that LibTorch links in (PyTorch's wheels), "MKL 2024.2 (in LibTorch)";
/// else "other BLAS".
std::string blas_library();

/// The folder of OpenBLAS's OpenMP build installed beside the OpenBLAS this
/// process mapped (Debian: /usr/lib/<multiarch>/openblas-openmp, package
/// libopenblas0-openmp), or "" when there is none.
std::string openblas_openmp_dir();

/// The folder to put first on LD_LIBRARY_PATH before training, or "": this
/// process runs OpenBLAS's pthreads build, the OpenMP build is installed,
/// and neither AMPX_TRAIN_BLAS=keep nor an earlier switch says otherwise.
/// The pthreads build's threads compete with LibTorch's spinning OpenMP
/// threads and run fp32 about 2x slower here, which would inflate every
/// mixed mode's speed-up over the fp32 baseline. Decided in the process at
/// run time, never from what a build script saw before the package was in.
std::string blas_dir_to_switch_to();

/// The settings table's BLAS line: the build, and why it is the one.
std::string blas_setting();

/// The settings table's line on how `dtype` (bf16, fp16) matrix products
/// run in ampx's regions on this CPU: LibTorch's kernels, or the float32 BLAS
/// (ampx::cpu_products_are_wide), and why.
std::string cpu_products_setting(c10::ScalarType dtype);

/// How this process multiplies `dtype` (bf16, fp16) matrices on the CPU in
/// ampx's regions: "wide" or "native" (ampx::cpu_products_are_wide), with
/// " (timed)" where auto chose by timing them in this process.
std::string cpu_products_used(c10::ScalarType dtype);

/// The AMPX_CPU_PRODUCTS value ("wide" or "native") that makes the processes
/// this one starts multiply each of `dtypes` (bf16, fp16) as it does, so
/// that they need not time the products anew (on a loaded machine they
/// could choose otherwise, and so sum in another order and run at another
/// speed); "" where nothing needs handing on: AMPX_CPU_PRODUCTS already set
/// (they inherit it), no 16-bit dtype, or dtypes whose choices differ
/// (one value cannot say both).
std::string cpu_products_for_children(const std::vector<c10::ScalarType>& dtypes);

/// A warning when the BLAS build is known to slow fp32 down here (empty
/// otherwise): OpenBLAS's pthreads build with more than one thread competes
/// for the cores with LibTorch's spinning OpenMP threads.
std::string blas_warning(int threads);

}  // namespace ampx::train
