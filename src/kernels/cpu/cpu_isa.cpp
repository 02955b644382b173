#include "ampx/detail/cpu_isa.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace ampx {
namespace detail {
namespace cpu {
namespace {

Isa hardware_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return __builtin_cpu_supports("avx512bf16") ? Isa::kAvx512Bf16 : Isa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return Isa::kAvx2;
  }
#endif
  return Isa::kDefault;
}

}  // namespace

std::string isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "default";
  }
}

Isa best_isa() {
  static const Isa isa = [] {
    Isa hw = hardware_isa();
    if (const char* env = std::getenv("ATEN_CPU_CAPABILITY")) {
      const std::string want = env;
      const Isa asked = want == "avx512_bf16" ? Isa::kAvx512Bf16
                        : want == "avx512"    ? Isa::kAvx512
                        : want == "avx2"      ? Isa::kAvx2
                        : want == "default"   ? Isa::kDefault
                                              : hw;
      if (static_cast<int>(asked) < static_cast<int>(hw)) hw = asked;
    }
    return hw;
  }();
  return isa;
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (int i = 0; i <= static_cast<int>(hardware_isa()); ++i) out.push_back(static_cast<Isa>(i));
  return out;
}

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
