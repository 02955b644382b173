#pragma once

// Runtime choice among ampx's CPU kernel builds. Each per-element kernel file
// is compiled three times (baseline x86-64, AVX2+FMA, AVX-512) with at::vec
// mapping to that instruction set, as ATen's own kernels are; the best one
// the CPU supports runs, unless ATEN_CPU_CAPABILITY (ATen's own variable:
// default, avx2, avx512) asks for a lower one.

#include <string>
#include <vector>

namespace ampx {
namespace detail {
namespace cpu {

enum class Isa { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

/// The kernel build used by default on this machine.
Isa best_isa();
/// Every build this CPU can run, lowest first (tests and benchmarks run all).
std::vector<Isa> supported_isas();
std::string isa_name(Isa isa);

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
