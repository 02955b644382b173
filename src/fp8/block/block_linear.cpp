// An FP8 layer under a block-scaled recipe (ampx/fp8/block_recipe.h): each
// product's operands quantized in blocks along its inner dimension, from the
// unquantized tensors, and multiplied as block-scaled products are; on the
// CPU or on CUDA (the casts' kernels, then float32 products of the blocks'
// values).

#include "../linear_internal.h"
#include "block_internal.h"

#include "../../kernels/function_args.h"
#include "ampx/fp8/block.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cstring>

namespace ampx {
namespace fp8 {
namespace {

// The formats of a layer's tensors under its recipe, each in blocks along
// its last dimension (the weight's rows grouped too when 2-D).
struct BlockRoles {
  BlockFormat input = BlockFormat::mxfp8();
  BlockFormat weight = BlockFormat::mxfp8();
  BlockFormat grad = BlockFormat::mxfp8();
  bool stochastic_grads = false;  // NVFP4's stochastic rounding of gradients
  bool hadamard = false;          // NVFP4's transform of the weight gradient's operands
};

BlockRoles block_roles(const Recipe& recipe) {
  BlockRoles r;
  switch (recipe.kind()) {
    case Recipe::Kind::kMxfp8: {
      const MXFP8BlockScaling& m = recipe.mxfp8();
      r.input = r.weight = BlockFormat::mxfp8(ElementFormat::kE4M3, m.scale_rule());
      r.grad = BlockFormat::mxfp8(m.fp8_format() == RecipeFormat::kHybrid ? ElementFormat::kE5M2
                                                                          : ElementFormat::kE4M3,
                                  m.scale_rule());
      if (m.weight_2d()) r.weight.block_rows(32);
      break;
    }
    case Recipe::Kind::kNvfp4: {
      const NVFP4BlockScaling& n = recipe.nvfp4();
      r.input = r.weight = r.grad = BlockFormat::nvfp4();
      if (n.weight_2d()) r.weight.block_rows(16);
      r.stochastic_grads = n.stochastic_rounding();
      r.hadamard = n.random_hadamard();
      break;
    }
    case Recipe::Kind::kFloat8Block: {
      const Float8BlockScaling& f = recipe.float8_block();
      r.input = BlockFormat(ElementFormat::kE4M3,
                            f.power_2_scale() ? ScaleRule::kFloat32Pow2 : ScaleRule::kFloat32)
                    .block_cols(f.block())
                    .amax_epsilon(f.amax_epsilon());
      r.grad = r.input;
      r.weight = BlockFormat(r.input).block_rows(f.block());
      break;
    }
    default:
      TORCH_CHECK(false, "ampx::fp8: ", recipe.to_string(), " is not a block-scaled recipe");
  }
  return r;
}

// A format's blocks turned down the columns (block_cols x 1): the copy of
// an operand whose product runs along its rows, quantized in place (TE's
// column-wise copy, without the transpose).
BlockFormat down_columns(const BlockFormat& f) {
  return BlockFormat(f).block_rows(f.block_cols()).block_cols(1);
}

// The weight's copies for the roles' weight format (block_weight_formats).
BlockWeightFormats weight_formats_of(const BlockRoles& roles) {
  BlockWeightFormats f;
  f.forward = roles.weight;
  f.shared = f.forward.block_rows() > 1;
  f.backward = f.shared ? f.forward : down_columns(f.forward);
  return f;
}

// The weight's quantization for `formats` (given, else made from w).
BlockTensor weight_for_forward(const GivenBlockWeight* given, const at::Tensor& w,
                               const BlockWeightFormats& formats) {
  if (given != nullptr) return given->forward;
  TORCH_CHECK(!is_weight_stand_in(w),
              "ampx::fp8: this layer's weight stands in for block codes a sharding wrapper "
              "gathered (FullyShardedDataParallel's fp8_all_gather), but the layer holds none for "
              "it: was it converted again while its unit was gathered?");
  return BlockTensor::quantize(w, formats.forward);
}

// An operand [tokens, features] for the weight-gradient product, through
// NVFP4's Hadamard transform along the tokens and bfloat16 (as TE's kernel
// writes it) when asked; the tokens must then be a multiple of 16.
at::Tensor along_tokens(const at::Tensor& t, bool hadamard) {
  if (!hadamard) return t;
  TORCH_CHECK_VALUE(t.size(0) % 16 == 0,
                    "ampx::fp8: NVFP4's random Hadamard transform runs over the tokens in tiles "
                    "of 16, got ",
                    t.size(0),
                    " tokens (make them a multiple of 16, or turn the transform off: "
                    "NVFP4BlockScaling().random_hadamard(false))");
  return hadamard16(t, /*inverse=*/false, /*dim=*/0).to(at::kBFloat16);
}

// a's block values times b's (each transposed where asked), times their
// tensor scales: a block-scaled product along the dimension both are in
// blocks along. On either device the block values are float32 (exact: a
// code times its block's scale) and at::mm sums their products in float32,
// as a block-scaled product defines it; on CUDA in cuBLAS's order, which
// differs from the CPU's only by the sums' roundings (docs/fp8.md). Not
// bf16 on CUDA: float32-scaled blocks' values do not fit in bf16, and a
// bf16 product rounds its float32 sum to 8 bits on the way out.
at::Tensor product(const BlockTensor& a, bool a_t, const BlockTensor& b, bool b_t) {
  const at::Tensor av = a.block_values(), bv = b.block_values();
  at::Tensor y = at::mm(a_t ? av.t() : av, b_t ? bv.t() : bv);
  const float alpha = detail::product_scale(a, b);
  if (alpha != 1.0f) y.mul_(alpha);
  return y;
}

struct SavedOperands : torch::CustomClassHolder {
  BlockTensor x_columns;  // x [N, in], in blocks down N
  BlockTensor w_columns;  // w [out, in], in blocks down out (or its 2-D blocks)
  BlockRoles roles;
  std::shared_ptr<LinearScaling> scaling;
};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct BlockLinearFunction : public torch::autograd::Function<BlockLinearFunction> {
  // bias as an optional (kernels/function_args.h).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias_arg,
                            std::shared_ptr<LinearScaling> scaling, c10::ScalarType out_dtype) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor bias = ampx::detail::tensor_or_undefined(bias_arg);
    const BlockRoles roles = block_roles(scaling->recipe);
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    const at::Tensor w = weight.detach();
    const BlockWeightFormats formats = weight_formats_of(roles);
    const GivenBlockWeight* given = scaling->given_block_weight(weight);
    const BlockTensor wq = weight_for_forward(given, w, formats);
    at::Tensor y = product(BlockTensor::quantize(x2, roles.input), false, wq, true);
    if (bias.defined()) y.add_(bias.to(at::kFloat));
    if (at::GradMode::is_enabled() || x.requires_grad() || weight.requires_grad()) {
      auto saved = c10::make_intrusive<SavedOperands>();
      saved->x_columns =
          BlockTensor::quantize(along_tokens(x2, roles.hadamard), down_columns(roles.input));
      saved->w_columns = formats.shared     ? wq
                         : given != nullptr ? given->backward
                                            : BlockTensor::quantize(w, formats.backward);
      saved->roles = roles;
      saved->scaling = std::move(scaling);
      ctx->saved_data["operands"] = c10::IValue::make_capsule(std::move(saved));
    }
    detail::LinearShape::save(ctx, x, weight, bias);
    return detail::linear_output(y.to(out_dtype), x, weight.size(0));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    auto* saved = static_cast<SavedOperands*>(ctx->saved_data["operands"].toCapsule().get());
    const BlockRoles& roles = saved->roles;
    const at::Tensor g = grads[0].reshape({-1, saved->w_columns.codes.size(0)}).to(at::kFloat);
    // NVFP4's stochastic rounding: this layer's stream, from where it stopped.
    c10::optional<StochasticRounding> rows_rounding, columns_rounding;
    const at::Tensor& rounding = saved->scaling->rounding;
    if (roles.stochastic_grads && rounding.defined()) {
      const at::Tensor state = rounding.cpu();
      const auto stream = static_cast<uint64_t>(state[0].item<int64_t>());
      const auto offset = static_cast<uint64_t>(state[1].item<int64_t>());
      rows_rounding = StochasticRounding{stream, offset};
      columns_rounding = StochasticRounding{stream, offset + static_cast<uint64_t>(g.numel())};
      rounding[1].fill_(static_cast<int64_t>(offset + 2 * static_cast<uint64_t>(g.numel())));
    }
    const detail::LinearShape shape = detail::LinearShape::load(ctx);
    const auto& x_sizes = shape.x_sizes;
    const auto x_dtype = shape.x_dtype;
    const auto w_dtype = shape.w_dtype;
    // grad_x [N, in] = g [N, out] . w [out, in], along out.
    const BlockTensor g_rows = BlockTensor::quantize(g, roles.grad, rows_rounding);
    at::Tensor grad_x = product(g_rows, false, saved->w_columns, false).view(x_sizes).to(x_dtype);
    // grad_w [out, in] = g^T [out, N] . x [N, in], along N.
    const BlockTensor g_columns = BlockTensor::quantize(along_tokens(g, roles.hadamard),
                                                        down_columns(roles.grad), columns_rounding);
    at::Tensor grad_w = product(g_columns, true, saved->x_columns, false).to(w_dtype);
    at::Tensor grad_b = shape.has_bias ? g.sum(0).to(w_dtype) : at::Tensor();
    return {grad_x, grad_w, grad_b, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

BlockWeightFormats block_weight_formats(const Recipe& recipe) {
  return weight_formats_of(block_roles(recipe));
}

void LinearScaling::give_block_weight(const at::Tensor& w, BlockTensor forward,
                                      BlockTensor backward) {
  const char* who = "ampx::fp8::LinearScaling::give_block_weight";
  const BlockWeightFormats formats = block_weight_formats(recipe);
  TORCH_CHECK(
      w.dim() == 2 && forward.codes.sizes() == w.sizes() && backward.codes.sizes() == w.sizes(),
      who, ": codes of the weight's shape ", w.sizes(), " expected, got ", forward.codes.sizes(),
      " and ", backward.codes.sizes());
  TORCH_CHECK(forward.format == formats.forward && backward.format == formats.backward, who, ": ",
              recipe.to_string(), " quantizes its weight in ", formats.forward.to_string(), " and ",
              formats.backward.to_string(), ", got ", forward.format.to_string(), " and ",
              backward.format.to_string());
  auto given = std::make_shared<GivenBlockWeight>(w);
  given->forward = std::move(forward);
  given->backward = std::move(backward);
  given_block_ = std::move(given);
}

const GivenBlockWeight* LinearScaling::given_block_weight(const at::Tensor& w) const {
  if (!given_block_ || w.is_inference()) return nullptr;
  const auto held = given_block_->weight.lock();
  return held.get() == w.unsafeGetTensorImpl() ? given_block_.get() : nullptr;
}

int64_t detail::rounding_stream(uint64_t seed, const at::Tensor& weight) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a over the seed and the weight's bits
  const auto mix = [&h](const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001B3ull;
  };
  mix(&seed, sizeof seed);
  if (weight.defined() && weight.numel() > 0) {
    const at::Tensor head =
        weight.detach().reshape({-1}).slice(0, 0, 64).to(at::kCPU, at::kFloat).contiguous();
    mix(head.data_ptr<float>(), static_cast<size_t>(head.numel()) * sizeof(float));
  }
  // FNV-1a moves differences upward only; murmur's finaliser spreads them
  // down before the sign bit is dropped (else seeds 0 and 1 could differ
  // there alone).
  h = (h ^ (h >> 33)) * 0xFF51AFD7ED558CCDull;
  h = (h ^ (h >> 33)) * 0xC4CEB9FE1A85EC53ull;
  h ^= h >> 33;
  return static_cast<int64_t>(h & 0x7FFFFFFFFFFFFFFFull);
}

at::Tensor detail::block_linear(const at::Tensor& x, const at::Tensor& weight,
                                const at::Tensor& bias,
                                const std::shared_ptr<LinearScaling>& scaling,
                                c10::ScalarType output_dtype) {
  TORCH_CHECK_VALUE(x.device() == weight.device() && (x.device().is_cpu() || x.is_cuda()),
                    "ampx::fp8: ", scaling->recipe.to_string(),
                    " takes x and the weight on the CPU or on one CUDA device, got x on ",
                    x.device(), " and the weight on ", weight.device());
  return BlockLinearFunction::apply(x, weight, ampx::detail::optional_tensor(bias), scaling,
                                    output_dtype);
}

}  // namespace fp8
}  // namespace ampx
