#pragma once

// How a kernel family picks its build, the one form every family uses (after
// ATen's DispatchStub): the family declares its functions once per build
// namespace (DEFAULT, AVX2, AVX512, each compiled with that instruction set),
// names what one build offers with a macro of the namespace, and gets its
// chooser from AMPX_ISA_DISPATCH:
//
//   #define AMPX_GELU_BUILD(ns) GeluKernels{&ns::gelu_span, &ns::gelu_backward_span}
//   AMPX_ISA_DISPATCH(GeluKernels, gelu_kernels_for, AMPX_GELU_BUILD)
//   gelu_kernels_for(best_isa()).forward(...);
//
// The build runs as best_isa() says (the CPU's best, or a lower one that
// ATEN_CPU_CAPABILITY asks for: ctest's kernels.isa_* runs test each). On
// AVX-512 CPUs with the bf16 dot product a family runs its AVX512 build; the
// one family with a build of its own there (attention) writes its chooser by
// hand.

#include "ampx/detail/cpu_isa.h"

#define AMPX_ISA_DISPATCH(Type, name, BUILD)       \
  inline Type name(::ampx::detail::cpu::Isa isa) { \
    switch (isa) {                                 \
      case ::ampx::detail::cpu::Isa::kAvx512Bf16:  \
      case ::ampx::detail::cpu::Isa::kAvx512:      \
        return BUILD(AVX512);                      \
      case ::ampx::detail::cpu::Isa::kAvx2:        \
        return BUILD(AVX2);                        \
      default:                                     \
        return BUILD(DEFAULT);                     \
    }                                              \
  }
