#pragma once

// ampx's own implementations behind ampx/kernels.h, exposed for the tests and
// benchmarks that compare them with ATen's. Users call ampx/kernels.h.

#include "ampx/detail/cpu_isa.h"
#include "ampx/kernels.h"

namespace ampx {
namespace detail {

/// Argument checks shared by every implementation (PyTorch's contract).
void check_unscale_args(at::TensorList grads, const at::Tensor& found_inf,
                        const at::Tensor& inv_scale);
void check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                             const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                             const ScaleUpdateRule& rule);

namespace cpu {
/// One pass per gradient: read, check finiteness, multiply, write; vectorized
/// with at::vec and split across threads with at::parallel_for in chunks that
/// span all tensors (multi-tensor style, so many small grads parallelise too).
void non_finite_check_and_unscale_(at::TensorList grads, at::Tensor& found_inf,
                                   const at::Tensor& inv_scale);
/// The same with a chosen instruction set (tests and benchmarks run each).
void non_finite_check_and_unscale_(at::TensorList grads, at::Tensor& found_inf,
                                   const at::Tensor& inv_scale, Isa isa);
void update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& hysteresis_tracker,
                   const at::Tensor& found_inf, const ScaleUpdateRule& rule);
/// ampx::mixed_gelu's fused kernel with a chosen instruction set, forward and
/// backward (x: a non-empty bfloat16 or float16 CPU tensor).
at::Tensor mixed_gelu(const at::Tensor& x, Isa isa);
/// ampx::scaled_dot_product_attention's fused kernel with a chosen
/// instruction set, forward and backward (see scaled_dot_product_attention_is_fused).
at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value, bool is_causal,
                                        std::optional<double> scale, Isa isa);
}  // namespace cpu

/// Device-generic versions built from ATen ops (no host sync): the CUDA path
/// where ATen has no kernel (bfloat16 grads, hysteresis), usable on any device.
void non_finite_check_and_unscale_composite_(at::TensorList grads, at::Tensor& found_inf,
                                             const at::Tensor& inv_scale);
void update_scale_composite_(at::Tensor& scale, at::Tensor& growth_tracker,
                             at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                             const ScaleUpdateRule& rule);

}  // namespace detail
}  // namespace ampx
