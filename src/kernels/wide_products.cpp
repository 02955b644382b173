// 16-bit matrix products through the float32 BLAS (ampx::wide_linear,
// ampx::wide_bmm, ampx::wide_matmul) and the choice of when ampx's regions
// use them (ampx::cpu_products_are_wide). On a CPU without AVX-512, LibTorch
// has no vectorized bfloat16 or float16 matrix product: oneDNN's bf16
// kernels need AVX-512 (or AMX), and ATen's fallback is a scalar loop
// (about 5 GFLOP/s on 2 Zen 3 cores against 150 for float32 through
// OpenBLAS: a bf16 training step 30x slower than the float32 one). Where
// oneDNN has them they can still trail the float32 BLAS (an Intel Xeon with
// AVX512-BF16 and no AMX: 187 against 351 GFLOP/s), so auto times both once.
//
// A product of 16-bit matrices with float32 accumulation, rounded once to
// 16 bits, is what every bf16/fp16 GEMM computes; the float32 BLAS computes
// the same from the widened inputs (every 16-bit value is a float32 value),
// in another summation order. Backward is done the same way, saving the
// 16-bit inputs (not float32 copies), so activation memory stays that of
// the 16-bit path.

#include "ampx/kernels/cpu_products.h"

#include "ampx/detail/compat.h"

#include "../dispatch/observer_key.h"
#include "gelu_passes.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>

namespace ampx {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool is_16bit(c10::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// The float32 products below must not meet autocast (a caller's region, or
// the autograd engine running backward inside one).
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard cpu{c10::DispatchKey::AutocastCPU};
};

// Forward, ampx's op observers (NonFiniteGuard, range statistics) see the
// op the program called (aten::linear, aten::matmul, ...: its 16-bit
// output, its module scope), not the float32 parts it is computed from.
// Backward they see the parts, under the node of the forward op's scope: an
// overflow there is reported on the float32 product, or on the rounding to
// float16 past 65504.
using HiddenFromObservers = detail::HiddenFromObserversGuard;

at::Tensor widen(const at::Tensor& t) { return t.to(at::kFloat); }

// The linear's products run over blocks of rows, so that the float32 copies
// of a block (its input, its product, its gradient) are what lives at a
// time, not float32 copies of the whole batch: about 4 MiB of them, and at
// least 256 rows (a product of fewer rows runs below the BLAS's speed). On
// ampx-train's gpt (4096 rows a step) O2's peak fell from 211.3 to 195.8 MiB
// (fp32: 314.7) at the same step time; 2 MiB blocks saved 2 MiB more and
// cost 7% of the step. Each output row is the same product of the same row
// in any blocking; the weight's and bias's gradients are sums over the
// blocks, in float32.
constexpr int64_t kBlockBytes = int64_t{4} << 20;
constexpr int64_t kMinBlockRows = 256;

int64_t rows_per_block(int64_t k, int64_t n) {
  return std::max(kMinBlockRows, kBlockBytes / (static_cast<int64_t>(sizeof(float)) * (k + n)));
}

// The GELU a wide linear may apply to its input first (wide_gelu_linear):
// ampx::mixed_gelu's passes with the instruction set of the forward, kept for
// backward's recompute (kNoGelu: none).
constexpr int64_t kNoGelu = -1;

// GELU of a block of x's rows into a new tensor: mixed_gelu's numbers.
at::Tensor gelu_rows(const at::Tensor& x, int64_t isa) {
  at::Tensor y = at::empty_like(x);
  detail::cpu::gelu_pass(x, y, static_cast<detail::cpu::Isa>(isa));
  return y;
}

// y[..., N] = a[..., K] w[N, K]^T (+ b[N]), one rounding to x's dtype, where
// a is x, or GELU(x) block by block (gelu_isa); and its gradients (db when
// b is defined). Shared by the two Functions below: LibTorch 1.13's custom
// Functions take no undefined tensor argument. x itself is saved, so with
// GELU its output is never whole: backward computes it again by blocks.
at::Tensor linear_forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                          const at::Tensor& b, int64_t gelu_isa) {
  NoAutocast no_autocast;
  HiddenFromObservers hidden;
  const int64_t k = x.size(-1), n = w.size(0);
  const at::Tensor xc = gelu_isa == kNoGelu ? x : x.contiguous();
  const at::Tensor x2 = xc.reshape({-1, k});
  const at::Tensor wt = widen(w).t();
  const at::Tensor b32 = b.defined() ? widen(b) : at::Tensor();
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  ctx->save_for_backward({xc, w});
  ctx->saved_data["gelu_isa"] = gelu_isa;
  // Not a view of a rounded product: callers may modify the result in place
  // (LibTorch's C++ Linear adds the bias with += on 3-D inputs), which
  // autograd forbids on a view made inside a custom Function.
  at::Tensor y = at::empty(sizes, x.options());
  const at::Tensor y2 = y.view({-1, n});
  const int64_t rows = x2.size(0), block = rows_per_block(k, n);
  for (int64_t r = 0; r < rows; r += block) {
    const int64_t len = std::min(block, rows - r);
    const at::Tensor a = x2.narrow(0, r, len);
    const at::Tensor ab = widen(gelu_isa == kNoGelu ? a : gelu_rows(a, gelu_isa));
    y2.narrow(0, r, len).copy_(b32.defined() ? at::addmm(b32, ab, wt) : at::mm(ab, wt));
  }
  return y;
}

variable_list linear_backward(AutogradContext* ctx, const at::Tensor& grad,
                              c10::optional<c10::ScalarType> bias_dtype) {
  NoAutocast no_autocast;
  const auto saved = ctx->get_saved_variables();
  const at::Tensor &x = saved[0], &w = saved[1];
  const int64_t gelu_isa = ctx->saved_data["gelu_isa"].toInt();
  const int64_t k = x.size(-1), n = w.size(0);
  const at::Tensor g2 = grad.reshape({-1, n}), x2 = x.reshape({-1, k});
  const bool dx = ctx->needs_input_grad(0), dw = ctx->needs_input_grad(1),
             db = bias_dtype && ctx->needs_input_grad(2);
  const at::Tensor w32 = dx ? widen(w) : at::Tensor();
  at::Tensor gx = dx ? at::empty(x.sizes(), x.options()) : at::Tensor();
  at::Tensor gw32 = dw ? at::zeros({n, k}, w.options().dtype(at::kFloat)) : at::Tensor();
  at::Tensor gb32 = db ? at::zeros({n}, grad.options().dtype(at::kFloat)) : at::Tensor();
  const at::Tensor gx2 = dx ? gx.view({-1, k}) : at::Tensor();
  const int64_t rows = g2.size(0), block = rows_per_block(k, n);
  for (int64_t r = 0; r < rows; r += block) {
    const int64_t len = std::min(block, rows - r);
    const at::Tensor gb = widen(g2.narrow(0, r, len)), a = x2.narrow(0, r, len);
    if (dx && gelu_isa == kNoGelu) gx2.narrow(0, r, len).copy_(at::mm(gb, w32));
    if (dx && gelu_isa != kNoGelu) {  // GELU's output gradient, rounded as mixed_gelu gets it
      const at::Tensor da = at::mm(gb, w32).to(x.scalar_type());
      detail::cpu::gelu_backward_pass(da, a, gx2.narrow(0, r, len),
                                      static_cast<detail::cpu::Isa>(gelu_isa));
    }
    if (dw) gw32.addmm_(gb.t(), widen(gelu_isa == kNoGelu ? a : gelu_rows(a, gelu_isa)));
    if (db) gb32.add_(gb.sum(0));
  }
  variable_list out(bias_dtype ? 4 : 3);
  out[0] = gx;
  if (dw) out[1] = gw32.to(w.scalar_type());
  if (db) out[2] = gb32.to(*bias_dtype);
  return out;
}

struct WideLinearFunction : public torch::autograd::Function<WideLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b, int64_t gelu_isa) {
    ctx->saved_data["bias_dtype"] = static_cast<int64_t>(b.scalar_type());
    return linear_forward(ctx, x, w, b, gelu_isa);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return linear_backward(
        ctx, grads[0], static_cast<c10::ScalarType>(ctx->saved_data["bias_dtype"].toInt()));
  }
};

struct WideLinearNoBiasFunction : public torch::autograd::Function<WideLinearNoBiasFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            int64_t gelu_isa) {
    return linear_forward(ctx, x, w, at::Tensor(), gelu_isa);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return linear_backward(ctx, grads[0], c10::nullopt);
  }
};

at::Tensor apply_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                        int64_t gelu_isa = kNoGelu) {
  return b.defined() ? WideLinearFunction::apply(x, w, b, gelu_isa)
                     : WideLinearNoBiasFunction::apply(x, w, gelu_isa);
}

// y[B, M, N] = a[B, M, K] b[B, K, N], one rounding to a's dtype.
struct WideBmmFunction : public torch::autograd::Function<WideBmmFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    NoAutocast no_autocast;
    HiddenFromObservers hidden;
    ctx->save_for_backward({a, b});
    return at::bmm(widen(a), widen(b)).to(a.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &a = saved[0], &b = saved[1];
    const at::Tensor g = widen(grads[0]);
    at::Tensor da, db;
    if (ctx->needs_input_grad(0)) {
      da = at::bmm(g, widen(b).transpose(1, 2)).to(a.scalar_type());
    }
    if (ctx->needs_input_grad(1)) {
      db = at::bmm(widen(a).transpose(1, 2), g).to(b.scalar_type());
    }
    return {da, db};
  }
};

void check_operands(const char* who, std::initializer_list<const at::Tensor*> operands) {
  const at::Tensor& first = **operands.begin();
  for (const at::Tensor* t : operands) {
    if (!t->defined()) continue;
    TORCH_CHECK_VALUE(t->device().is_cpu() && is_16bit(t->scalar_type()), who,
                      ": operands must be bfloat16 or float16 CPU tensors, got ",
                      t->scalar_type(), " on ", t->device());
    TORCH_CHECK_VALUE(t->scalar_type() == first.scalar_type(), who,
                      ": operands must share one dtype, got ", first.scalar_type(), " and ",
                      t->scalar_type());
  }
}

// wide_linear's and wide_gelu_linear's operands, errors naming `who`.
void check_linear(const char* who, const at::Tensor& x, const at::Tensor& weight,
                  const at::Tensor& bias) {
  check_operands(who, {&x, &weight, &bias});
  TORCH_CHECK_VALUE(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1), who,
                    ": x [..., in] and weight [out, in] must agree, got x ", x.sizes(),
                    " and weight ", weight.sizes());
  TORCH_CHECK_VALUE(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)), who,
                    ": bias must be [out] = [", weight.size(0), "], got ", bias.sizes());
}

// AMPX_CPU_PRODUCTS, read once; set_cpu_products replaces it.
CpuProducts mode_from_environment() {
  const char* env = std::getenv("AMPX_CPU_PRODUCTS");
  if (env == nullptr || *env == '\0') return CpuProducts::kAuto;
  const std::string value = env;
  if (value == "native") return CpuProducts::kNative;
  if (value == "wide") return CpuProducts::kWide;
  TORCH_CHECK_VALUE(value == "auto", "AMPX_CPU_PRODUCTS must be auto, native or wide, got \"",
                    value, "\"");
  return CpuProducts::kAuto;
}

std::atomic<int>& mode_storage() {
  static std::atomic<int> mode{static_cast<int>(mode_from_environment())};
  return mode;
}

}  // namespace

const char* to_string(CpuProducts mode) {
  switch (mode) {
    case CpuProducts::kAuto: return "auto";
    case CpuProducts::kNative: return "native";
    case CpuProducts::kWide: return "wide";
  }
  return "?";
}

void set_cpu_products(CpuProducts mode) { mode_storage().store(static_cast<int>(mode)); }

CpuProducts get_cpu_products() { return static_cast<CpuProducts>(mode_storage().load()); }

bool cpu_has_native_products(c10::ScalarType dtype) {
  if (!is_16bit(dtype)) return true;
  // LibTorch 1.13 has no float16 CPU product at all ("addmm_impl_cpu_" not
  // implemented for 'Half'); the 2.x releases ampx runs on have them.
  if (dtype == at::kHalf && !AMPX_TORCH_AT_LEAST(2, 1)) return false;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // oneDNN's bf16 and fp16 matrix kernels, which LibTorch calls for 16-bit
  // products, need AVX-512 (F, BW, VL, DQ: LibTorch's own test before it
  // calls them); for fp16 also AVX512-FP16, without which LibTorch 2.x
  // multiplies fp16 in a loop (and 1.13 not at all).
  static const bool avx512 =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
  static const bool avx512_fp16 = avx512 && __builtin_cpu_supports("avx512fp16");
#else
  static const bool avx512_fp16 = false;
#endif
  return dtype == at::kBFloat16 ? avx512 : avx512_fp16;
#else
  // Other architectures: LibTorch's own kernels (Arm's have bf16 paths).
  return true;
#endif
}

bool auto_products_are_wide(bool native_kernels, double native_gflops, double float32_gflops) {
  return !native_kernels || native_gflops < kAutoWideBelow * float32_gflops;
}

namespace {

// The probe's product: two n x n matrices, about 0.9 GFLOP at n = 768 (2.5
// to 5 ms a run on 2 cores of the machines measured), large enough to run
// at the BLAS's speed.
constexpr int64_t kProbeSize = 768;
constexpr int kProbeRuns = 5;

// Best of kProbeRuns products of `dtype` and of float32, interleaved (a
// burst of other load slows both alike), after one untimed run of each.
CpuProductsProbe measure(c10::ScalarType dtype) {
  CpuProductsProbe probe;
  probe.native_kernels = cpu_has_native_products(dtype);
  if (probe.native_kernels) {
    // Plain LibTorch products: no autocast region's cast or route (ampx's
    // included), no observer, no autograd.
    NoAutocast no_autocast;
    HiddenFromObservers hidden;
    at::NoGradGuard no_grad;
    // Small integers over 8, exact in every dtype, drawn from no generator:
    // the probe must not move the user's random stream.
    const auto ramp =
        at::arange(kProbeSize * kProbeSize, at::kFloat).view({kProbeSize, kProbeSize});
    const auto a32 = (ramp.remainder(13) - 6) / 8, b32 = (ramp.remainder(7) - 3) / 8;
    const auto a16 = a32.to(dtype), b16 = b32.to(dtype);
    const auto seconds = [](const at::Tensor& a, const at::Tensor& b) {
      const auto start = std::chrono::steady_clock::now();
      const auto c = at::mm(a, b);
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    seconds(a16, b16);
    seconds(a32, b32);
    double best16 = 1e30, best32 = 1e30;
    for (int i = 0; i < kProbeRuns; ++i) {
      best16 = std::min(best16, seconds(a16, b16));
      best32 = std::min(best32, seconds(a32, b32));
    }
    const double flop = 2.0 * kProbeSize * kProbeSize * kProbeSize;
    probe.native_gflops = flop / best16 / 1e9;
    probe.float32_gflops = flop / best32 / 1e9;
  }
  probe.wide = auto_products_are_wide(probe.native_kernels, probe.native_gflops,
                                      probe.float32_gflops);
  return probe;
}

}  // namespace

const CpuProductsProbe& cpu_products_probe(c10::ScalarType dtype) {
  TORCH_CHECK_VALUE(is_16bit(dtype), "ampx::cpu_products_probe: dtype must be bfloat16 or "
                    "float16, got ", dtype);
  // Each measured once, at its first use (static initialisation is thread-safe).
  if (dtype == at::kBFloat16) {
    static const CpuProductsProbe bf16 = measure(at::kBFloat16);
    return bf16;
  }
  static const CpuProductsProbe fp16 = measure(at::kHalf);
  return fp16;
}

bool cpu_products_are_wide(c10::ScalarType dtype) {
  if (!is_16bit(dtype)) return false;
  switch (get_cpu_products()) {
    case CpuProducts::kNative: return false;
    case CpuProducts::kWide: return true;
    case CpuProducts::kAuto: break;
  }
  return cpu_products_probe(dtype).wide;
}

bool wide_linear_supports(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  return x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1) &&
         (!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)));
}

at::Tensor wide_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  check_linear("ampx::wide_linear", x, weight, bias);
  return apply_linear(x, weight, bias);
}

at::Tensor wide_gelu_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  check_linear("ampx::wide_gelu_linear", x, weight, bias);
  return apply_linear(x, weight, bias, static_cast<int64_t>(detail::cpu::best_isa()));
}

at::Tensor wide_bmm(const at::Tensor& a, const at::Tensor& b) {
  check_operands("ampx::wide_bmm", {&a, &b});
  TORCH_CHECK_VALUE(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) &&
                        a.size(2) == b.size(1),
                    "ampx::wide_bmm: a [B, M, K] and b [B, K, N] must agree, got ", a.sizes(),
                    " and ", b.sizes());
  return WideBmmFunction::apply(a, b);
}

bool wide_matmul_supports(const at::Tensor& a, const at::Tensor& b) {
  if (a.dim() < 2 || b.dim() < 2 || a.size(-1) != b.size(-2)) return false;
  if (b.dim() == 2) return true;
  return a.dim() == b.dim() && a.sizes().slice(0, a.dim() - 2) == b.sizes().slice(0, b.dim() - 2);
}

at::Tensor wide_matmul(const at::Tensor& a, const at::Tensor& b) {
  check_operands("ampx::wide_matmul", {&a, &b});
  TORCH_CHECK_VALUE(wide_matmul_supports(a, b),
                    "ampx::wide_matmul: needs a [..., M, K] with b [K, N] or b [..., K, N] of the "
                    "same batch sizes, got ",
                    a.sizes(), " and ", b.sizes());
  if (b.dim() == 2) return apply_linear(a, b.t(), at::Tensor());
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  auto sizes = a.sizes().vec();
  sizes.back() = n;
  // reshape: a view when the batch dimensions allow it (a transposed key in
  // attention does), a 16-bit copy otherwise.
  return WideBmmFunction::apply(a.reshape({-1, m, k}), b.reshape({-1, k, n})).view(sizes);
}

}  // namespace ampx
