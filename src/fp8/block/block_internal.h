#pragma once

// What the block-scaled recipes share inside src/fp8: the recipes' names
// (block_recipe.cpp), NVFP4's rounding stream and the autograd function of
// a layer under a block recipe (block_linear.cpp).

#include "ampx/fp8/block.h"
#include "ampx/fp8/scaling.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <memory>

namespace ampx {
namespace fp8 {
namespace detail {

/// What a block-scaled product of a and b multiplies its float32 sum of
/// block values by: TE's alpha, amax_a * amax_b / (6 * 6 * 448 * 448), when
/// both are NVFP4, else the product of their tensor scales (1).
float product_scale(const BlockTensor& a, const BlockTensor& b);

/// "e4m3", "hybrid", "e5m2".
const char* recipe_format_name(RecipeFormat format);

/// The stochastic-rounding stream of a layer: a hash of `seed` and the bits
/// of its initial `weight` (a CPU or CUDA tensor; its first 64 elements), so
/// that layers differ and a rebuilt model draws the same numbers.
int64_t rounding_stream(uint64_t seed, const at::Tensor& weight);

/// y = x w^T + bias under scaling.recipe, a block-scaled one (block_recipe.h),
/// in output_dtype; the autograd function fp8_linear runs for those recipes.
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                        const std::shared_ptr<LinearScaling>& scaling,
                        c10::ScalarType output_dtype);

}  // namespace detail
}  // namespace fp8
}  // namespace ampx
