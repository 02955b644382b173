#pragma once

// Runtime choice among ampx's CPU kernel builds. Each per-element kernel file
// is compiled three times (baseline x86-64, AVX2+FMA, AVX-512) with at::vec
// mapping to that instruction set, as ATen's own kernels are; the best one
// the CPU supports runs, unless ATEN_CPU_CAPABILITY (ATen's own variable:
// default, avx2, avx512) asks for a lower one. A fourth level, AVX-512 with
// the bf16 dot product (vdpbf16ps, Zen 4, Cooper Lake, Sapphire Rapids), has
// a build of its own only where it pays (the attention kernel's bf16
// products); every other kernel runs its AVX-512 build there.

#include <string>
#include <vector>

namespace ampx {
namespace detail {
namespace cpu {

enum class Isa { kDefault = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

/// The kernel build used by default on this machine (ATEN_CPU_CAPABILITY=avx512
/// leaves out the bf16 dot product; ampx also takes avx512_bf16).
Isa best_isa();
/// Every build this CPU can run, lowest first (tests and benchmarks run all).
std::vector<Isa> supported_isas();
std::string isa_name(Isa isa);

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
