#pragma once

/// \file
/// 16-bit matrix products on the CPU: whether ampx's regions multiply
/// bfloat16/float16 matrices in LibTorch's own kernels or "wide", in the
/// float32 BLAS rounded once to 16 bits (CpuProducts), and the wide products
/// themselves (wide_linear, wide_gelu_linear, wide_bmm, wide_matmul).
///
/// ```
///   ampx::get_cpu_products();                        // CpuProducts::kAuto (AMPX_CPU_PRODUCTS
///   unset) ampx::cpu_products_are_wide(torch::kBFloat16);   // true where bf16 products are slow
///   here ampx::cpu_products_probe(torch::kBFloat16);      // what auto measured: GFLOP/s of both
///   auto y = ampx::wide_linear(x, w, b);             // bf16 x, w, b: bf16 y, float32 sums
///   auto z = ampx::wide_gelu_linear(h, w, b);        // wide_linear(mixed_gelu(h), w, b), keeping
///   h
/// ```

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

namespace ampx {

/// How ampx's mixed-precision regions multiply bfloat16/float16 matrices on
/// the CPU. LibTorch's 16-bit products are fast only where oneDNN has
/// kernels for them (x86 CPUs with AVX-512, for float16 also AVX512-FP16);
/// elsewhere (AVX2 CPUs such as AMD Zen 1-3) it runs a scalar loop, about 30x
/// slower than its float32 product, and so does Python's torch.autocast.
/// Even with those kernels a 16-bit product can be the slower one: on an
/// Intel Xeon with AVX512-BF16 and no AMX, oneDNN's bf16 products ran at
/// 187 GFLOP/s on 2 cores against MKL's float32 351 (AMD Zen 4: 406 against
/// 202). "Wide" products multiply the 16-bit inputs in the float32 BLAS and
/// round the result once to 16 bits: the numbers of a 16-bit GEMM with float32
/// accumulation (in another summation order), at float32 speed, with the
/// 16-bit inputs (not float32 copies) saved for backward.
enum class CpuProducts {
  /// Wide where LibTorch's 16-bit products are slower than its float32 ones
  /// on this machine: where the CPU lacks the instructions they need
  /// (cpu_has_native_products), or where they ran below
  /// kAutoWideBelow times the float32 rate when timed (cpu_products_probe).
  /// LibTorch's own otherwise. The default.
  kAuto,
  /// Always LibTorch's own kernels.
  kNative,
  /// Always wide.
  kWide,
};

/// "auto", "native", "wide".
const char* to_string(CpuProducts mode);

/// Sets the process-wide mode. The initial one comes from the environment
/// variable AMPX_CPU_PRODUCTS (auto, native or wide; unset: auto), read at the
/// first use; another value is an error naming it.
void set_cpu_products(CpuProducts mode);
/// The process-wide mode (see set_cpu_products).
CpuProducts get_cpu_products();

/// Whether LibTorch multiplies `dtype` matrices on this CPU with vectorized
/// kernels (always true for float32 and float64; never for float16 on
/// LibTorch 1.13, which has no float16 CPU product).
bool cpu_has_native_products(c10::ScalarType dtype);

/// What CpuProducts::kAuto found for one 16-bit dtype, measured once per
/// process at the first use of that dtype's choice (cpu_products_probe).
struct CpuProductsProbe {
  /// cpu_has_native_products(dtype). Without them nothing is timed: the
  /// product is a scalar loop, and auto is wide.
  bool native_kernels = false;
  /// LibTorch's product of two 768 x 768 matrices of the dtype in GFLOP/s:
  /// best of 5 runs, interleaved with the float32 ones, at the intra-op
  /// thread count of the first use; 0 when not timed.
  double native_gflops = 0;
  /// The same for two float32 matrices.
  double float32_gflops = 0;
  /// Auto's choice: auto_products_are_wide() of the three above.
  bool wide = false;
};

/// Auto is wide where the 16-bit products ran below this fraction of the
/// float32 rate. The wide path costs a little more than a float32 product
/// (the widening copies and the one rounding), so it is chosen only with a
/// margin; the machines measured so far lie far from it on either side
/// (0.53 and 2.0, the two CPUs named in CpuProducts' comment).
constexpr double kAutoWideBelow = 0.8;

/// Auto's rule, on the numbers of a CpuProductsProbe: wide without native
/// kernels, or when native_gflops < kAutoWideBelow * float32_gflops.
bool auto_products_are_wide(bool native_kernels, double native_gflops, double float32_gflops);

/// What auto measured for `dtype` (bfloat16 or float16; another dtype is an
/// error naming it), timing the products on the first call for that dtype
/// (about 0.1 s and 11 MiB of matrices for that time where LibTorch has
/// 16-bit kernels, nothing where it has not) and returning the same numbers
/// after. The first AmpSession or AutocastGuard on the CPU calls it; a
/// program that measures its peak memory calls it before (as ampx-train
/// does). The products run outside autocast and ampx's observers. Timing
/// makes the choice a measurement: a machine whose two rates lay within a
/// few percent of the margin could choose differently from one process to
/// the next (and so round differently); AMPX_CPU_PRODUCTS=native or wide
/// fixes it.
const CpuProductsProbe& cpu_products_probe(c10::ScalarType dtype);

/// Whether ampx's regions (AutocastGuard, AmpSession::forward_guard(),
/// WideProductsGuard) route `dtype` products through wide_linear and
/// wide_matmul now: never for float32/float64, else by get_cpu_products()
/// (kAuto: cpu_products_probe(dtype).wide).
bool cpu_products_are_wide(c10::ScalarType dtype);

/// `at::linear(x, weight, bias)` for 16-bit CPU operands of one dtype (x
/// [..., in], weight [out, in], bias [out] or undefined), computed in the
/// float32 BLAS and rounded once to x's dtype; the gradients likewise (each in
/// its operand's dtype). Errors name the operand that is not a 16-bit CPU
/// tensor of the shared dtype, or the sizes that do not agree.
at::Tensor wide_linear(const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& bias = at::Tensor());
/// Whether the sizes fit wide_linear (x [..., in], weight [out, in], bias
/// [out] or undefined); dtypes are not looked at.
bool wide_linear_supports(const at::Tensor& x, const at::Tensor& weight,
                          const at::Tensor& bias = at::Tensor());

/// `wide_linear(mixed_gelu(x), weight, bias)` (ampx/kernels/gelu.h), the same
/// numbers bit for bit forward and backward, keeping x for backward instead
/// of GELU's output: the output exists only a block of rows at a time, in
/// forward and again in backward, where GELU runs a second time (and its
/// output's gradient is not kept whole either). A transformer's MLP tail
/// without its largest saved activation, for one more GELU a step. ampx's op
/// observers see neither the GELU nor the product. Operands and errors as
/// wide_linear's.
at::Tensor wide_gelu_linear(const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias = at::Tensor());

/// `at::bmm(a, b)` the same way (a [B, M, K], b [B, K, N]).
at::Tensor wide_bmm(const at::Tensor& a, const at::Tensor& b);

/// `at::matmul(a, b)` the same way, for the shapes of linear layers and
/// attention: a [..., M, K] with b [K, N], or with b [..., K, N] of the same
/// batch sizes (wide_matmul_supports); other shapes are an error.
at::Tensor wide_matmul(const at::Tensor& a, const at::Tensor& b);
/// Whether the sizes fit wide_matmul (a [..., M, K] with b [K, N], or b
/// [..., K, N] of a's batch sizes); dtypes are not looked at.
bool wide_matmul_supports(const at::Tensor& a, const at::Tensor& b);

}  // namespace ampx
