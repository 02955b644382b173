// ampx::scaled_dot_product_attention: fused (flash-attention style) CPU
// attention for float32, bfloat16 and float16 q, k, v with float32 math
// (kernels/isa/attention_span.cpp), forward and backward, and the composite
// of ATen ops everywhere else.
//
// Saved for backward: q, k, v (the tensors given, no copies when their rows
// are contiguous), the output, its rounding error as 16-bit codes (16-bit
// outputs only: backward's rowsum(dout * out) needs the float32 output), and
// one float32 log-sum-exp per query row: nothing of size T x S, where the
// composite keeps the probabilities.

#include "ampx/kernels/attention.h"

#include "ampx/detail/compat.h"
#include "ampx/detail/kernels.h"

#include "isa/attention_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace ampx {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool fused_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// The argument checks every path shares: at least 2-D, one dtype (floating)
// and device, the same leading sizes, q and k of one width, k and v of one
// length.
void check_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const char* who = "ampx::scaled_dot_product_attention";
  TORCH_CHECK(q.defined() && k.defined() && v.defined(), who,
              ": query, key and value must be defined tensors");
  TORCH_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim(), who,
              ": query, key and value must have one number of dimensions, at least 2 ([..., L, E], "
              "[..., S, E], [..., S, Ev]); got query ",
              q.sizes(), ", key ", k.sizes(), ", value ", v.sizes());
  TORCH_CHECK(q.is_floating_point(), who, ": query must be a floating-point tensor, got ",
              q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), who,
              ": query, key and value must have one dtype; got query ", q.scalar_type(), ", key ",
              k.scalar_type(), ", value ", v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), who,
              ": query, key and value must be on one device; got query on ", q.device(),
              ", key on ", k.device(), ", value on ", v.device());
  const int64_t lead = q.dim() - 2;
  TORCH_CHECK(q.sizes().slice(0, lead) == k.sizes().slice(0, lead) &&
                  q.sizes().slice(0, lead) == v.sizes().slice(0, lead),
              who,
              ": query, key and value must have the same leading (batch, head) sizes; got query ",
              q.sizes(), ", key ", k.sizes(), ", value ", v.sizes());
  TORCH_CHECK(k.size(-1) == q.size(-1), who, ": key's last size (", k.size(-1),
              ") must equal query's (", q.size(-1), ")");
  TORCH_CHECK(v.size(-2) == k.size(-2), who, ": value's length (", v.size(-2),
              ", second to last size) must equal key's (", k.size(-2), ")");
}

double resolved_scale(const at::Tensor& q, std::optional<double> scale) {
  return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

// Rows with contiguous elements: t itself, else a contiguous copy.
at::Tensor with_contiguous_rows(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

// The element offset of each head's first row (heads: the leading sizes,
// flattened in order).
std::vector<int64_t> head_offsets(const at::Tensor& t) {
  const int64_t lead = t.dim() - 2;
  int64_t heads = 1;
  for (int64_t d = 0; d < lead; ++d) heads *= t.size(d);
  std::vector<int64_t> offsets(heads);
  for (int64_t h = 0; h < heads; ++h) {
    int64_t rest = h, offset = 0;
    for (int64_t d = lead - 1; d >= 0; --d) {
      offset += rest % t.size(d) * t.stride(d);
      rest /= t.size(d);
    }
    offsets[h] = offset;
  }
  return offsets;
}

// A result shaped like `like` ([..., rows, width]); 4-D ones laid out
// [B, rows, H, width] in memory (strides, not a permuted view: a view made
// inside a custom Function could not be modified in place), so that
// `y.transpose(1, 2).reshape({B, rows, H * width})`, the usual merge of the
// heads, is free.
at::Tensor empty_heads(const at::Tensor& like, int64_t width,
                       at::ScalarType dtype = at::ScalarType::Undefined) {
  auto sizes = like.sizes().vec();
  sizes.back() = width;
  const auto options =
      like.options().dtype(dtype == at::ScalarType::Undefined ? like.scalar_type() : dtype);
  if (like.dim() == 4) {
    const int64_t heads = sizes[1], rows = sizes[2];
    return at::empty_strided(sizes, {rows * heads * width, width, heads * width, 1}, options);
  }
  return at::empty(sizes, options);
}

struct Operand {
  at::Tensor tensor;
  std::vector<int64_t> heads;
  detail::cpu::AttentionRows rows() const {
    detail::cpu::AttentionRows r;
    r.data = static_cast<char*>(tensor.data_ptr());
    r.head = heads.data();
    r.row = tensor.stride(-2);
    return r;
  }
};

Operand operand(const at::Tensor& t) {
  return Operand{t, head_offsets(t)};
}

detail::cpu::AttentionProblem problem_of(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, bool causal, double scale) {
  detail::cpu::AttentionProblem p;
  p.dtype = q.scalar_type();
  p.t = q.size(-2);
  p.s = k.size(-2);
  p.e = q.size(-1);
  p.ev = v.size(-1);
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  return p;
}

int64_t head_count(const at::Tensor& q) {
  int64_t heads = 1;
  for (int64_t d = 0; d + 2 < q.dim(); ++d) heads *= q.size(d);
  return heads;
}

struct FusedAttentionFunction : public torch::autograd::Function<FusedAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, bool causal, double scale, int64_t isa) {
    const Operand q = operand(with_contiguous_rows(query)), k = operand(with_contiguous_rows(key)),
                  v = operand(with_contiguous_rows(value));
    const bool sixteen = query.scalar_type() != at::kFloat;
    const Operand out = operand(empty_heads(query, value.size(-1)));
    const Operand residual =
        sixteen ? operand(empty_heads(query, value.size(-1), at::kShort)) : Operand{};
    const int64_t heads = head_count(query);
    at::Tensor lse = at::empty({heads, query.size(-2)}, query.options().dtype(at::kFloat));
    auto p = problem_of(query, key, value, causal, scale);
    p.q = q.rows();
    p.k = k.rows();
    p.v = v.rows();
    p.out = out.rows();
    if (sixteen) p.residual = residual.rows();
    p.lse = lse.data_ptr<float>();
    const auto kernels = detail::cpu::attention_kernels_for(static_cast<detail::cpu::Isa>(isa));
    at::parallel_for(0, heads, 1, [&](int64_t h0, int64_t h1) { kernels.forward(p, h0, h1); });
    ctx->save_for_backward({q.tensor, k.tensor, v.tensor, out.tensor, residual.tensor, lse});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["isa"] = isa;
    return out.tensor;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The gradients come from raw buffers, with no graph of their own: a
    // second derivative (create_graph) would silently miss this op.
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "ampx::scaled_dot_product_attention: the fused CPU kernel is not twice "
                "differentiable (backward with create_graph=true)");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &query = saved[0], &key = saved[1], &value = saved[2];
    const bool causal = ctx->saved_data["causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto isa = static_cast<detail::cpu::Isa>(ctx->saved_data["isa"].toInt());
    const Operand q = operand(query), k = operand(key), v = operand(value), out = operand(saved[3]);
    const Operand residual = saved[4].defined() ? operand(saved[4]) : Operand{};
    const Operand dout = operand(with_contiguous_rows(grads[0].to(query.scalar_type())));
    const Operand dq = operand(empty_heads(query, query.size(-1)));
    const Operand dk = operand(empty_heads(key, key.size(-1)));
    const Operand dv = operand(empty_heads(value, value.size(-1)));
    auto p = problem_of(query, key, value, causal, scale);
    p.q = q.rows();
    p.k = k.rows();
    p.v = v.rows();
    p.out = out.rows();
    if (residual.tensor.defined()) p.residual = residual.rows();
    p.lse = saved[5].data_ptr<float>();
    p.dout = dout.rows();
    p.dq = dq.rows();
    p.dk = dk.rows();
    p.dv = dv.rows();
    const auto kernels = detail::cpu::attention_kernels_for(isa);
    at::parallel_for(0, head_count(query), 1,
                     [&](int64_t h0, int64_t h1) { kernels.backward(p, h0, h1); });
    return {dq.tensor, dk.tensor, dv.tensor, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// softmax(q k^T * scale, causal mask) v from ATen ops, the softmax in at
// least float32, the result in q's dtype.
at::Tensor composite_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               bool causal, double scale) {
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (causal) {
    const at::Tensor hidden =
        at::ones({q.size(-2), k.size(-2)}, q.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  }
  const auto math = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::matmul(at::softmax(scores, -1, math).to(q.scalar_type()), v);
}

}  // namespace

bool scaled_dot_product_attention_is_fused(const at::Tensor& query, const at::Tensor& key,
                                           const at::Tensor& value) {
  const auto plain = [](const at::Tensor& t) {
    return t.defined() && t.layout() == at::kStrided && !t.is_nested();
  };
  return plain(query) && plain(key) && plain(value) && query.device().is_cpu() &&
         key.device().is_cpu() && value.device().is_cpu() && fused_dtype(query.scalar_type()) &&
         key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type() &&
         query.dim() >= 2 && key.dim() == query.dim() && value.dim() == query.dim() &&
         query.size(-2) > 0 && key.size(-2) > 0 && query.size(-1) > 0 && value.size(-1) > 0 &&
         query.numel() > 0;
}

at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value, bool is_causal,
                                        std::optional<double> scale) {
  check_args(query, key, value);
  if (scaled_dot_product_attention_is_fused(query, key, value)) {
    return detail::cpu::scaled_dot_product_attention(query, key, value, is_causal, scale,
                                                     detail::cpu::best_isa());
  }
#if AMPX_TORCH_AT_LEAST(2, 1)
  if (!query.device().is_cpu()) {
    // LibTorch's own fused kernels (flash, memory-efficient) where it has them.
    return at::scaled_dot_product_attention(query, key, value, {}, 0.0, is_causal,
                                            resolved_scale(query, scale));
  }
#endif
  return composite_attention(query, key, value, is_causal, resolved_scale(query, scale));
}

namespace detail {
namespace cpu {

at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value, bool is_causal,
                                        std::optional<double> scale, Isa isa) {
  check_args(query, key, value);
  TORCH_CHECK(scaled_dot_product_attention_is_fused(query, key, value),
              "ampx::scaled_dot_product_attention: the CPU kernel takes non-empty float32, "
              "bfloat16 or float16 CPU tensors, got ",
              query.scalar_type(), " on ", query.device());
  return FusedAttentionFunction::apply(query, key, value, is_causal, resolved_scale(query, scale),
                                       static_cast<int64_t>(isa));
}

}  // namespace cpu
}  // namespace detail

}  // namespace ampx
