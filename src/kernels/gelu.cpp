// ampx::mixed_gelu: exact GELU of bfloat16/float16 activations with the math
// in float32 (kernels/isa/activation_span.cpp), forward and backward, saving
// the 16-bit input. LibTorch 1.13's own bfloat16 gelu_backward runs on
// Vectorized<BFloat16>, which widens, computes and rounds back at every
// operation: a quarter of a gpt O2 step's non-matrix time, and a gradient
// rounded several times (docs/performance-notes.md).

#include "ampx/kernels/gelu.h"

#include "ampx/detail/kernels.h"

#include "function_args.h"
#include "gelu_passes.h"
#include "isa/activation_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

namespace ampx {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct MixedGeluFunction : public torch::autograd::Function<MixedGeluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t isa) {
    const at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty_like(xc);
    detail::cpu::gelu_pass(xc, y, static_cast<detail::cpu::Isa>(isa));
    ctx->save_for_backward({xc});
    ctx->saved_data["isa"] = isa;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor dy = grads[0].to(x.scalar_type()).contiguous();
    at::Tensor dx = at::empty_like(x);
    detail::cpu::gelu_backward_pass(dy, x, dx,
                                    static_cast<detail::cpu::Isa>(ctx->saved_data["isa"].toInt()));
    return {dx, at::Tensor()};
  }
};

}  // namespace

bool mixed_gelu_is_fused(const at::Tensor& x) {
  return x.defined() && x.device().is_cpu() &&
         (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) && x.numel() > 0;
}

at::Tensor mixed_gelu(const at::Tensor& x) {
  if (!mixed_gelu_is_fused(x)) {
    if (!x.is_floating_point() || x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble) {
      return at::gelu(x);
    }
    return at::gelu(x.to(at::kFloat)).to(x.scalar_type());
  }
  return detail::cpu::mixed_gelu(x, detail::cpu::best_isa());
}

namespace detail {
namespace cpu {

void gelu_pass(const at::Tensor& x, const at::Tensor& y, Isa isa) {
  const auto gelu = gelu_kernels_for(isa).forward;
  const auto* xp = static_cast<const char*>(x.data_ptr());
  auto* yp = static_cast<char*>(y.data_ptr());
  const auto dtype = x.scalar_type();
  const int64_t size = static_cast<int64_t>(x.element_size());
  at::parallel_for(0, x.numel(), kElementwiseGrain, [&](int64_t i0, int64_t i1) {
    gelu(xp + i0 * size, dtype, yp + i0 * size, i1 - i0);
  });
}

void gelu_backward_pass(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dx, Isa isa) {
  const auto gelu_backward = gelu_kernels_for(isa).backward;
  const auto* xp = static_cast<const char*>(x.data_ptr());
  const auto* dyp = static_cast<const char*>(dy.data_ptr());
  auto* dxp = static_cast<char*>(dx.data_ptr());
  const auto dtype = x.scalar_type();
  const int64_t size = static_cast<int64_t>(x.element_size());
  at::parallel_for(0, x.numel(), kElementwiseGrain, [&](int64_t i0, int64_t i1) {
    gelu_backward(dyp + i0 * size, xp + i0 * size, dtype, dxp + i0 * size, i1 - i0);
  });
}

at::Tensor mixed_gelu(const at::Tensor& x, Isa isa) {
  TORCH_CHECK(mixed_gelu_is_fused(x),
              "mixed_gelu: the CPU kernel takes a non-empty bfloat16 or float16 CPU tensor, got ",
              x.scalar_type(), " on ", x.device());
  return MixedGeluFunction::apply(x, static_cast<int64_t>(isa));
}

}  // namespace cpu
}  // namespace detail

}  // namespace ampx
