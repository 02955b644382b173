#pragma once

/// \file
/// The two kernels of dynamic loss scaling, usable on their own (e.g. by a
/// custom optimizer or trainer). Each routes to ATen's own kernel where this
/// LibTorch build has one for the tensors' device, and to ampx's otherwise:
/// LibTorch 1.13 has CPU kernels for neither, and CUDA's unscale kernel lacks
/// bfloat16. No function here synchronises with the host.
///
/// ```
///   auto found_inf = torch::zeros({1});            // float32, caller zeroes
///   ampx::non_finite_check_and_unscale_(grads, found_inf, inv_scale);
///   ampx::update_scale_(scale, growth_tracker, hysteresis_tracker, found_inf, rule);
/// ```

#include "ampx/scale_update.h"

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>

namespace ampx {

/// In place, for every tensor `g` in `grads`: `g *= inv_scale`, and
/// `found_inf = 1` if any element of any `g` is inf or NaN. `found_inf` is
/// never reset to 0 here (the caller zeroes it). `found_inf` and `inv_scale`
/// are 1-element float32 tensors on the grads' device; grads may be float32,
/// float64, float16 or bfloat16, each strided. Same contract as ATen's
/// `_amp_foreach_non_finite_check_and_unscale_`.
void non_finite_check_and_unscale_(at::TensorList grads, at::Tensor& found_inf,
                                   const at::Tensor& inv_scale);

/// One update of the loss scale, in place, on the scale's device, by `rule`
/// (see ScaleUpdateRule for the rule). `scale`: float32 [1]; trackers: int32
/// [1]; `found_inf`: float32 [1]. With hysteresis == 1 and no bounds this is
/// exactly ATen's `_amp_update_scale_`.
void update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& hysteresis_tracker,
                   const at::Tensor& found_inf, const ScaleUpdateRule& rule);

/// LayerNorm over the last `normalized_shape` dimensions of a 16-bit input
/// with float32 statistics and float32 weight and bias, returned in x's
/// dtype: what `at::layer_norm(x.float(), ...).to(x.dtype())` computes (the
/// float32 norm of O2 and of autocast's fp32 policy), in one pass over the
/// rows forward and one backward on the CPU, saving the 16-bit input (not a
/// float32 copy) for backward. The gradients: dx in x's dtype, dweight and
/// dbias float32, summed in a fixed order (the same bits on any thread
/// count). Other devices and dtypes run the composite above. O2's norms use
/// it (CastPolicy::kFp32OutputsAsInput on aten::layer_norm); under O1,
/// `set_cast_policy("aten::layer_norm", CastPolicy::kFp32OutputsAsInput)`
/// makes autocast use it too.
at::Tensor mixed_layer_norm(const at::Tensor& x, at::IntArrayRef normalized_shape,
                            const at::Tensor& weight, const at::Tensor& bias, double eps = 1e-5);

/// Whether mixed_layer_norm runs the fused CPU kernel for these arguments
/// (CPU, bfloat16 or float16 x whose trailing sizes are normalized_shape,
/// float32 or undefined weight and bias of that shape, at least one element).
bool mixed_layer_norm_is_fused(const at::Tensor& x, at::IntArrayRef normalized_shape,
                               const at::Tensor& weight, const at::Tensor& bias);

/// Batch norm of a 16-bit input [N, C, *] with float32 statistics, weight,
/// bias and running statistics (updated in place when training, as
/// at::batch_norm does: momentum, unbiased running variance), returned in x's
/// dtype: what `at::batch_norm(x.float(), ...).to(x.dtype())` computes (O2's
/// fp32 batch norm), channel by channel in passes over the 16-bit input on
/// the CPU, saving the 16-bit input for backward (dx in x's dtype, dweight
/// and dbias float32). Other devices and dtypes run that composite. O2's
/// norms use it (kFp32OutputsAsInput on aten::batch_norm).
at::Tensor mixed_batch_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            const at::Tensor& running_mean, const at::Tensor& running_var,
                            bool training, double momentum = 0.1, double eps = 1e-5);

/// Whether mixed_batch_norm runs the fused CPU kernel for these arguments
/// (CPU, bfloat16 or float16 x with at least 2 dimensions, float32 or
/// undefined contiguous [C] weight, bias and running statistics, the running
/// statistics defined when not training).
bool mixed_batch_norm_is_fused(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, const at::Tensor& running_mean,
                               const at::Tensor& running_var, bool training);

/// Exact GELU (`approximate="none"`) of a 16-bit input with the math in
/// float32, returned in x's dtype: `at::gelu(x.float()).to(x.dtype())`
/// forward and backward (dx = dy * (Phi(x) + x * phi(x)), rounded once to
/// x's dtype), within one 16-bit ulp of float64, saving the 16-bit input. On
/// the CPU in one vectorized pass each way (erf by a polynomial sharing its
/// exp with the normal density); other devices run that composite, float32
/// and float64 inputs plain at::gelu. O2 (KeepNormsFp32Guard) runs bf16/fp16
/// GELUs on the CPU through it: LibTorch 1.13's bf16 GELU backward is
/// several times slower (docs/performance-notes.md).
at::Tensor mixed_gelu(const at::Tensor& x);

/// Whether mixed_gelu runs the fused CPU kernel for x (CPU, bfloat16 or
/// float16, at least one element).
bool mixed_gelu_is_fused(const at::Tensor& x);

/// Scaled dot-product attention, `softmax(query key^T * scale) value` with
/// an optional causal mask: what `at::scaled_dot_product_attention(query,
/// key, value, {}, 0.0, is_causal, scale)` computes (LibTorch 2.x), on every
/// LibTorch ampx builds with. query [..., L, E], key [..., S, E], value
/// [..., S, Ev], one dtype and device, the same leading sizes (no
/// broadcasting); `scale` defaults to 1 / sqrt(E); `is_causal` lets query i
/// see keys j <= i (the top-left aligned mask PyTorch uses). Returns
/// [..., L, Ev] in query's dtype.
///
/// On the CPU, for float32, bfloat16 and float16, one fused kernel each way
/// (flash-attention style): the scores are made in float32 tiles (bf16 Q K^T
/// and dO V^T with AVX512-BF16's exact bf16 dot product where the CPU has
/// it, float32 sums) and never stored whole, the causal mask is applied by index (tiles above the
/// diagonal are skipped), the softmax statistics are float32, and each
/// output and gradient element is rounded once: within one 16-bit ulp of a
/// float64 reference, the same bits on any thread count. It saves the
/// inputs, the output (and its rounding error, for 16-bit outputs) and one
/// float32 per query row: nothing of size L x S. A 4-D result is laid out
/// [B, L, H, Ev] in memory, so that merging the heads with
/// `y.transpose(1, 2).reshape({B, L, H * Ev})` copies nothing. Elsewhere it
/// runs LibTorch's own SDPA (2.x, on accelerators) or a composite of matmul,
/// masked_fill and a float32 softmax. Not twice differentiable. On LibTorch
/// 2.1+, ampx's mixed-precision regions on the CPU (O1's AutocastGuard, O2's
/// and O3's forward guard: WideProductsGuard) route 16-bit
/// `at::scaled_dot_product_attention` calls without mask or dropout here.
at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value, bool is_causal = false,
                                        std::optional<double> scale = std::nullopt);

/// Whether scaled_dot_product_attention runs the fused CPU kernel for these
/// arguments (strided CPU tensors; float32, bfloat16 or float16; no empty
/// dimension).
bool scaled_dot_product_attention_is_fused(const at::Tensor& query, const at::Tensor& key,
                                           const at::Tensor& value);

/// How ampx's mixed-precision regions multiply bfloat16/float16 matrices on
/// the CPU. LibTorch's 16-bit products are fast only where oneDNN has
/// kernels for them (x86 CPUs with AVX-512, for float16 also AVX512-FP16);
/// elsewhere (AVX2 CPUs such as AMD Zen 1-3) it runs a scalar loop, about 30x
/// slower than its float32 product, and so does Python's torch.autocast.
/// "Wide" products multiply the 16-bit inputs in the float32 BLAS and round
/// the result once to 16 bits: the numbers of a 16-bit GEMM with float32
/// accumulation (in another summation order), at float32 speed, with the
/// 16-bit inputs (not float32 copies) saved for backward.
enum class CpuProducts {
  /// Wide where the CPU lacks the instructions LibTorch's 16-bit products need
  /// (cpu_has_native_products), LibTorch's own otherwise. The default.
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
/// kernels (always true for float32 and float64).
bool cpu_has_native_products(c10::ScalarType dtype);

/// Whether ampx's regions (AutocastGuard, AmpSession::forward_guard(),
/// WideProductsGuard) route `dtype` products through wide_linear and
/// wide_matmul now: never for float32/float64, else by get_cpu_products().
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
