// ampx::max_pool2d: max pooling over non-overlapping windows of a contiguous
// (NCHW) CPU tensor. LibTorch's kernel for that layout (cpu_max_pool) walks
// each window with the general index arithmetic (padding, dilation,
// ceil_mode) and a branch on every comparison, which on a ReLU's output is a
// coin toss: on 2 cores about 3 ns an input element, 9.2 ms of a profiled
// mnist-cnn step (its two pools, on [128, 32, 28, 28] and [128, 64, 14, 14])
// against 4.9 for its two convolutions. Here the 2 x 2 window (the common
// one) runs as selects the compiler vectorizes, other windows as masked
// selects; the winner's place in its window is kept in one byte for
// backward, where LibTorch keeps an int64 index.
//
// The same values and gradients as LibTorch's, bit for bit: the window is
// scanned in row-major order from minus infinity, an element wins if it is
// larger than the best so far or NaN, and the output is the winner in the
// op's math type rounded back (a bfloat16 NaN comes out as LibTorch makes
// it). Backward writes 0 + dy at each winner (0 + -0 is +0, as LibTorch's
// zero-filled `+=` gives) and zero everywhere else.

#include "ampx/kernels/pooling.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace ampx {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The largest window whose winner's place fits the byte saved for backward.
constexpr int64_t kMaxWindow = 255;
// Outputs per parallel task: enough to outweigh a task's start.
constexpr int64_t kOutputsPerTask = 16384;

// One argument of max_pool2d's int[2] form: one value for both dimensions
// or two; `fallback` where it is empty.
bool pair_of(at::IntArrayRef v, at::IntArrayRef fallback, int64_t out[2]) {
  if (v.empty()) v = fallback;
  if (v.size() == 1) {
    out[0] = out[1] = v[0];
    return true;
  }
  if (v.size() != 2) return false;
  out[0] = v[0];
  out[1] = v[1];
  return true;
}

// The sizes the kernel runs on: planes (N x C) of h x w in, oh x ow out.
struct PoolShape {
  int64_t planes, h, w, oh, ow, kh, kw;
  int64_t rows() const { return planes * oh; }  // output rows
  // Where output row r's windows start in the input (and its gradient).
  int64_t input_offset(int64_t r) const { return (r / oh) * h * w + (r % oh) * kh * w; }
  int64_t grain() const { return std::max<int64_t>(1, kOutputsPerTask / ow); }
};

PoolShape pool_shape(const at::Tensor& x, int64_t kh, int64_t kw) {
  const int64_t h = x.size(-2), w = x.size(-1);
  return {x.numel() / (h * w), h, w, h / kh, w / kw, kh, kw};
}

// x's sizes with the last two pooled, uninitialized, of `dtype`.
at::Tensor empty_output(const at::Tensor& x, const PoolShape& s, at::ScalarType dtype) {
  auto sizes = x.sizes().vec();
  sizes[sizes.size() - 2] = s.oh;
  sizes.back() = s.ow;
  return at::empty(sizes, x.options().dtype(dtype));
}

// take ? a : b by masks, never a branch: GCC makes a plain select a branch
// in scalar code (the general window's loop, a vector loop's remainder), and
// on a ReLU's output the condition is a coin toss.
template <class T>
T pick(bool take, T a, T b) {
  using Bits = std::conditional_t<sizeof(T) == 2, uint16_t,
                                  std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;
  static_assert(sizeof(T) == sizeof(Bits), "pick: a 16-, 32- or 64-bit value");
  const auto mask = static_cast<Bits>(Bits{0} - static_cast<Bits>(take));
  return std::bit_cast<T>(
      static_cast<Bits>((std::bit_cast<Bits>(a) & mask) | (std::bit_cast<Bits>(b) & ~mask)));
}

inline int pick(bool take, int a, int b) {
  const int mask = -static_cast<int>(take);
  return (a & mask) | (b & ~mask);
}

// One output row of 2 x 2 windows over input rows in0 and in1 (T float or
// double): the compiler vectorizes it. Starting from the window's first
// element is starting from minus infinity: it wins unless it is -inf, which
// then stays the best with place 0 all the same.
template <class T, bool kPlaces>
void pool_pair(const T* __restrict in0, const T* __restrict in1, T* __restrict out,
               uint8_t* __restrict place, int64_t ow) {
  for (int64_t j = 0; j < ow; ++j) {
    T best = in0[2 * j];
    int where = 0;
    const T rest[3] = {in0[2 * j + 1], in1[2 * j], in1[2 * j + 1]};
    for (int e = 0; e < 3; ++e) {
      const bool wins = (rest[e] > best) | (rest[e] != rest[e]);  // larger, or NaN
      best = pick(wins, rest[e], best);
      where = pick(wins, e + 1, where);
    }
    out[j] = best;
    if constexpr (kPlaces) place[j] = static_cast<uint8_t>(where);
  }
}

// Output rows [r0, r1) of 2 x 2 windows. 16-bit rows are widened into
// float32 rows first (exact) and the outputs rounded back as LibTorch's
// kernel rounds its float32 maximum.
template <class scalar_t, bool kPlaces>
void pool_rows_2x2(const scalar_t* x, scalar_t* y, uint8_t* code, const PoolShape& s, int64_t r0,
                   int64_t r1) {
  const int64_t w = s.w, ow = s.ow;
  constexpr bool kWide = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>;
  std::vector<float> rows(kWide ? 0 : 3 * 2 * ow);
  for (int64_t r = r0; r < r1; ++r) {
    const scalar_t* in = x + s.input_offset(r);
    uint8_t* place = kPlaces ? code + r * ow : nullptr;
    if constexpr (kWide) {
      pool_pair<scalar_t, kPlaces>(in, in + w, y + r * ow, place, ow);
    } else {
      float *in0 = rows.data(), *in1 = in0 + 2 * ow, *out = in1 + 2 * ow;
      for (int64_t c = 0; c < 2 * ow; ++c) {
        in0[c] = static_cast<float>(in[c]);
        in1[c] = static_cast<float>(in[w + c]);
      }
      pool_pair<float, kPlaces>(in0, in1, out, place, ow);
      for (int64_t j = 0; j < ow; ++j) y[r * ow + j] = static_cast<scalar_t>(out[j]);
    }
  }
}

// Output rows [r0, r1) of any window: the scan in LibTorch's order, from
// minus infinity, in the op's math type.
template <class scalar_t, bool kPlaces>
void pool_rows_any(const scalar_t* x, scalar_t* y, uint8_t* code, const PoolShape& s, int64_t r0,
                   int64_t r1) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t kh = s.kh, kw = s.kw, w = s.w, ow = s.ow;
  for (int64_t r = r0; r < r1; ++r) {
    const scalar_t* in = x + s.input_offset(r);
    for (int64_t j = 0; j < ow; ++j) {
      opmath_t best = -std::numeric_limits<opmath_t>::infinity();
      int where = 0;
      for (int64_t a = 0; a < kh; ++a) {
        for (int64_t b = 0; b < kw; ++b) {
          const auto v = static_cast<opmath_t>(in[a * w + j * kw + b]);
          const bool wins = (v > best) | (v != v);
          best = pick(wins, v, best);
          where = pick(wins, static_cast<int>(a * kw + b), where);
        }
      }
      y[r * ow + j] = static_cast<scalar_t>(best);
      if constexpr (kPlaces) code[r * ow + j] = static_cast<uint8_t>(where);
    }
  }
}

// 0 + dy in dy's math type: LibTorch's backward adds each gradient into a
// zeroed input gradient (so -0 becomes +0).
template <class scalar_t>
scalar_t added_to_zero(scalar_t g) {
  using opmath_t = at::opmath_type<scalar_t>;
  return static_cast<scalar_t>(opmath_t(0) + static_cast<opmath_t>(g));
}

// dx for output rows [r0, r1) of 2 x 2 windows: each input element its
// output's gradient where it won, zero elsewhere, by masks (vectorized for
// float32).
template <class scalar_t>
void unpool_rows_2x2(const scalar_t* dy, const uint8_t* code, scalar_t* dx, const PoolShape& s,
                     int64_t r0, int64_t r1) {
  const int64_t w = s.w, ow = s.ow;
  const auto zero = static_cast<scalar_t>(0);
  for (int64_t r = r0; r < r1; ++r) {
    scalar_t* __restrict in0 = dx + s.input_offset(r);
    scalar_t* __restrict in1 = in0 + w;
    const scalar_t* __restrict g = dy + r * ow;
    const uint8_t* __restrict place = code + r * ow;
    for (int64_t j = 0; j < ow; ++j) {
      const scalar_t v = added_to_zero(g[j]);
      const uint8_t p = place[j];
      in0[2 * j] = pick(p == 0, v, zero);
      in0[2 * j + 1] = pick(p == 1, v, zero);
      in1[2 * j] = pick(p == 2, v, zero);
      in1[2 * j + 1] = pick(p == 3, v, zero);
    }
    std::fill(in0 + 2 * ow, in0 + w, zero);  // the column no window covers
    std::fill(in1 + 2 * ow, in1 + w, zero);
  }
}

// The same for any window: each window's rows zeroed, then 0 + dy stored at
// its winner.
template <class scalar_t>
void unpool_rows_any(const scalar_t* dy, const uint8_t* code, scalar_t* dx, const PoolShape& s,
                     int64_t r0, int64_t r1) {
  const int64_t kh = s.kh, kw = s.kw, w = s.w, ow = s.ow;
  for (int64_t r = r0; r < r1; ++r) {
    scalar_t* in = dx + s.input_offset(r);
    std::fill(in, in + kh * w, static_cast<scalar_t>(0));
    for (int64_t j = 0; j < ow; ++j) {
      const int64_t p = code[r * ow + j];
      in[(p / kw) * w + j * kw + p % kw] = added_to_zero(dy[r * ow + j]);
    }
  }
}

// Zeroes the input gradient's rows that no window covers (below the last
// window row of each plane).
template <class scalar_t>
void zero_uncovered_rows(scalar_t* dx, const PoolShape& s, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    if (r % s.oh != s.oh - 1) continue;
    std::fill(dx + s.input_offset(r) + s.kh * s.w, dx + (r / s.oh + 1) * s.h * s.w,
              static_cast<scalar_t>(0));
  }
}

void pool(const at::Tensor& x, at::Tensor& y, uint8_t* code, const PoolShape& s) {
  const bool two = s.kh == 2 && s.kw == 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "ampx::max_pool2d", [&] {
        const auto* xp = x.data_ptr<scalar_t>();
        auto* yp = y.data_ptr<scalar_t>();
        at::parallel_for(0, s.rows(), s.grain(), [&](int64_t r0, int64_t r1) {
          if (two && code) pool_rows_2x2<scalar_t, true>(xp, yp, code, s, r0, r1);
          if (two && !code) pool_rows_2x2<scalar_t, false>(xp, yp, code, s, r0, r1);
          if (!two && code) pool_rows_any<scalar_t, true>(xp, yp, code, s, r0, r1);
          if (!two && !code) pool_rows_any<scalar_t, false>(xp, yp, code, s, r0, r1);
        });
      });
}

void unpool(const at::Tensor& dy, const uint8_t* code, at::Tensor& dx, const PoolShape& s) {
  const bool two = s.kh == 2 && s.kw == 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, dy.scalar_type(), "ampx::max_pool2d_backward", [&] {
        const auto* dyp = dy.data_ptr<scalar_t>();
        auto* dxp = dx.data_ptr<scalar_t>();
        at::parallel_for(0, s.rows(), s.grain(), [&](int64_t r0, int64_t r1) {
          if (two) {
            unpool_rows_2x2<scalar_t>(dyp, code, dxp, s, r0, r1);
          } else {
            unpool_rows_any<scalar_t>(dyp, code, dxp, s, r0, r1);
          }
          zero_uncovered_rows<scalar_t>(dxp, s, r0, r1);
        });
      });
}

struct MaxPool2dFunction : public torch::autograd::Function<MaxPool2dFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t kh, int64_t kw) {
    const PoolShape s = pool_shape(x, kh, kw);
    at::Tensor y = empty_output(x, s, x.scalar_type());
    at::Tensor code = empty_output(x, s, at::kByte);
    pool(x, y, code.data_ptr<uint8_t>(), s);
    ctx->save_for_backward({code});
    ctx->saved_data["sizes"] = x.sizes().vec();
    ctx->saved_data["kernel"] = std::vector<int64_t>{kh, kw};
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor code = ctx->get_saved_variables()[0];
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const auto kernel = ctx->saved_data["kernel"].toIntVector();
    const at::Tensor dy = grads[0].contiguous();
    if (at::GradMode::is_enabled()) {
      return {differentiable_backward(dy, code, sizes, kernel), at::Tensor(), at::Tensor()};
    }
    at::Tensor dx = at::empty(sizes, dy.options());
    const PoolShape s = pool_shape(dx, kernel[0], kernel[1]);
    unpool(dy, code.data_ptr<uint8_t>(), dx, s);
    return {dx, at::Tensor(), at::Tensor()};
  }

  // Backward under create_graph (a gradient penalty differentiates it
  // again): LibTorch's own backward op on the int64 indices the places
  // stand for, so its derivative is LibTorch's too.
  static at::Tensor differentiable_backward(const at::Tensor& dy, const at::Tensor& code,
                                            const std::vector<int64_t>& sizes,
                                            const std::vector<int64_t>& kernel) {
    const int64_t kh = kernel[0], kw = kernel[1], w = sizes.back();
    const auto longs = dy.options().dtype(at::kLong);
    const at::Tensor place = code.to(at::kLong);
    const at::Tensor row =
        at::arange(code.size(-2), longs).unsqueeze(1) * kh + place.div(kw, "floor");
    const at::Tensor col = at::arange(code.size(-1), longs) * kw + place.remainder(kw);
    const at::Tensor indices = row * w + col;
    return at::max_pool2d_with_indices_backward(dy, at::empty(sizes, dy.options()), {kh, kw},
                                                {kh, kw}, {0, 0}, {1, 1}, false, indices);
  }
};

}  // namespace

bool max_pool2d_is_fused(const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                         at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  if (!x.defined() || !x.device().is_cpu() || !x.is_floating_point() || ceil_mode ||
      (x.dim() != 3 && x.dim() != 4) || x.numel() == 0 || !x.is_contiguous()) {
    return false;
  }
  int64_t k[2] = {}, st[2] = {}, pad[2] = {}, dil[2] = {};
  if (!pair_of(kernel_size, kernel_size, k) || !pair_of(stride, kernel_size, st) ||
      !pair_of(padding, padding, pad) || !pair_of(dilation, dilation, dil)) {
    return false;
  }
  return k[0] >= 1 && k[1] >= 1 && k[0] * k[1] <= kMaxWindow && st[0] == k[0] && st[1] == k[1] &&
         pad[0] == 0 && pad[1] == 0 && dil[0] == 1 && dil[1] == 1 && k[0] <= x.size(-2) &&
         k[1] <= x.size(-1);
}

at::Tensor max_pool2d(const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                      at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  if (!max_pool2d_is_fused(x, kernel_size, stride, padding, dilation, ceil_mode)) {
    return at::max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode);
  }
  int64_t k[2] = {0, 0};
  pair_of(kernel_size, kernel_size, k);
  if (!(at::GradMode::is_enabled() && x.requires_grad())) {  // nothing to keep for backward
    const PoolShape s = pool_shape(x, k[0], k[1]);
    at::Tensor y = empty_output(x, s, x.scalar_type());
    pool(x, y, nullptr, s);
    return y;
  }
  return MaxPool2dFunction::apply(x, k[0], k[1]);
}

}  // namespace ampx
