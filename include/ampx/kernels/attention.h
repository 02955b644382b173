#pragma once

/// \file
/// Scaled dot-product attention on every LibTorch ampx builds with, fused on
/// the CPU (flash-attention style, float32 statistics, one rounding per
/// output element); ampx's mixed-precision regions route 16-bit CPU
/// at::scaled_dot_product_attention calls to it (LibTorch 2.1+).
///
/// ```
///   auto q = torch::randn({2, 4, 128, 64}).to(torch::kBFloat16);  // [B, H, L, E]
///   auto y = ampx::scaled_dot_product_attention(q, k, v, /*is_causal=*/true);
///   y.sizes();                                                    // [2, 4, 128, 64], bfloat16
///   ampx::scaled_dot_product_attention_is_fused(q, k, v);         // true: the CPU kernel
/// ```

#include <ATen/core/Tensor.h>

#include <optional>

namespace ampx {

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
/// it, float32 sums) and never stored whole, the causal mask is applied by
/// index (tiles above the diagonal are skipped), the softmax statistics are
/// float32, and each
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

}  // namespace ampx
