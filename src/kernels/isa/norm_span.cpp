// The row kernels of ampx's mixed-precision LayerNorm, compiled once per
// instruction set (see norm_kernels.h). Each row is widened to float32 once
// into a buffer, normalised there, and narrowed once on the way out: the
// 16-bit tensors are read and written exactly once per pass. Sums run in
// float32 vectors and are reduced lane by lane in a fixed order, so a row's
// result does not depend on the thread that runs it.

#include "norm_kernels.h"
#include "span_convert.h"
#include "vec_math.h"

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace ampx {
namespace detail {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

int64_t element_size(c10::ScalarType dtype) {
  return dtype == c10::kFloat ? 4 : 2;
}

}  // namespace

void layer_norm_rows(const void* x, c10::ScalarType dtype, const float* w, const float* b, void* y,
                     float* mean, float* rstd, int64_t r0, int64_t r1, int64_t n, float eps) {
  std::vector<float> buf(static_cast<size_t>(n));
  float* xb = buf.data();
  const int64_t row_bytes = n * element_size(dtype);
  const int64_t nv = n - n % FVec::size();
  for (int64_t r = r0; r < r1; ++r) {
    widen(static_cast<const char*>(x) + r * row_bytes, dtype, xb, n);
    FVec acc(0.f);
    for (int64_t i = 0; i < nv; i += FVec::size()) acc = acc + FVec::loadu(xb + i);
    float s = lane_sum(acc);
    for (int64_t i = nv; i < n; ++i) s += xb[i];
    const float m = s / static_cast<float>(n);
    const FVec vm(m);
    FVec sq(0.f);
    for (int64_t i = 0; i < nv; i += FVec::size()) {
      const FVec d = FVec::loadu(xb + i) - vm;
      sq = at::vec::fmadd(d, d, sq);
    }
    float ss = lane_sum(sq);
    for (int64_t i = nv; i < n; ++i) ss += (xb[i] - m) * (xb[i] - m);
    const float rs = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    const FVec vrs(rs);
    int64_t i = 0;
    for (; i < nv; i += FVec::size()) {
      FVec v = (FVec::loadu(xb + i) - vm) * vrs;
      if (w) v = v * FVec::loadu(w + i);
      if (b) v = v + FVec::loadu(b + i);
      v.store(xb + i);
    }
    for (; i < n; ++i) {
      float v = (xb[i] - m) * rs;
      if (w) v = v * w[i];
      if (b) v = v + b[i];
      xb[i] = v;
    }
    narrow(xb, static_cast<char*>(y) + r * row_bytes, dtype, n);
    mean[r] = m;
    rstd[r] = rs;
  }
}

void layer_norm_backward_rows(const void* dy, const void* x, c10::ScalarType dtype,
                              const float* mean, const float* rstd, const float* w, void* dx,
                              float* dw, float* db, int64_t r0, int64_t r1, int64_t n) {
  std::vector<float> buf(2 * static_cast<size_t>(n));
  float* xb = buf.data();  // x, then xhat, then dx
  float* gb = xb + n;      // dy, then dy * w
  const int64_t row_bytes = n * element_size(dtype);
  const int64_t nv = n - n % FVec::size();
  const float inv_n = 1.f / static_cast<float>(n);
  for (int64_t r = r0; r < r1; ++r) {
    widen(static_cast<const char*>(x) + r * row_bytes, dtype, xb, n);
    widen(static_cast<const char*>(dy) + r * row_bytes, dtype, gb, n);
    const FVec vm(mean[r]), vrs(rstd[r]);
    FVec a1(0.f), a2(0.f);
    int64_t i = 0;
    for (; i < nv; i += FVec::size()) {
      const FVec xhat = (FVec::loadu(xb + i) - vm) * vrs;
      FVec g = FVec::loadu(gb + i);
      if (dw) (FVec::loadu(dw + i) + g * xhat).store(dw + i);
      if (db) (FVec::loadu(db + i) + g).store(db + i);
      if (w) g = g * FVec::loadu(w + i);
      a1 = a1 + g;
      a2 = at::vec::fmadd(g, xhat, a2);
      xhat.store(xb + i);
      g.store(gb + i);
    }
    float s1 = lane_sum(a1), s2 = lane_sum(a2);
    for (; i < n; ++i) {
      const float xhat = (xb[i] - mean[r]) * rstd[r];
      float g = gb[i];
      if (dw) dw[i] += g * xhat;
      if (db) db[i] += g;
      if (w) g *= w[i];
      s1 += g;
      s2 += g * xhat;
      xb[i] = xhat;
      gb[i] = g;
    }
    const float c1 = s1 * inv_n, c2 = s2 * inv_n;
    const FVec vc1(c1), vc2(c2);
    for (i = 0; i < nv; i += FVec::size()) {
      const FVec xhat = FVec::loadu(xb + i);
      (vrs * (FVec::loadu(gb + i) - vc1 - xhat * vc2)).store(xb + i);
    }
    for (; i < n; ++i) xb[i] = rstd[r] * (gb[i] - c1 - xb[i] * c2);
    narrow(xb, static_cast<char*>(dx) + r * row_bytes, dtype, n);
  }
}

// ---- batch norm: one channel of x [nb, channels, s] at a time --------------
//
// Each (sample, channel) plane is s contiguous values, widened into a float32
// buffer a block at a time. Sums are float32 vector lanes per plane, added
// into a double per channel in plane order: fixed, whatever the threads.

namespace {

constexpr int64_t kBlock = 2048;

// f(plane_index, offset, block_pointer(float32), length) over channel c.
template <class F>
void for_each_block(const void* x, c10::ScalarType dtype, int64_t nb, int64_t channels, int64_t s,
                    int64_t c, float* buf, F&& f) {
  const int64_t es = element_size(dtype);
  for (int64_t n = 0; n < nb; ++n) {
    const char* plane = static_cast<const char*>(x) + ((n * channels + c) * s) * es;
    for (int64_t o = 0; o < s; o += kBlock) {
      const int64_t len = std::min(kBlock, s - o);
      widen(plane + o * es, dtype, buf, len);
      f(n, o, buf, len);
    }
  }
}

float sum_of(const float* v, int64_t len) {
  const int64_t nv = len - len % FVec::size();
  FVec acc(0.f);
  for (int64_t i = 0; i < nv; i += FVec::size()) acc = acc + FVec::loadu(v + i);
  float s = lane_sum(acc);
  for (int64_t i = nv; i < len; ++i) s += v[i];
  return s;
}

}  // namespace

double channel_sum(const void* x, c10::ScalarType dtype, int64_t nb, int64_t channels, int64_t s,
                   int64_t c) {
  float buf[kBlock];
  double total = 0;
  for_each_block(x, dtype, nb, channels, s, c, buf,
                 [&](int64_t, int64_t, const float* v, int64_t len) { total += sum_of(v, len); });
  return total;
}

double channel_sq_dev(const void* x, c10::ScalarType dtype, int64_t nb, int64_t channels, int64_t s,
                      int64_t c, float mean) {
  float buf[kBlock];
  double total = 0;
  const FVec vm(mean);
  for_each_block(x, dtype, nb, channels, s, c, buf,
                 [&](int64_t, int64_t, const float* v, int64_t len) {
                   const int64_t nv = len - len % FVec::size();
                   FVec acc(0.f);
                   for (int64_t i = 0; i < nv; i += FVec::size()) {
                     const FVec d = FVec::loadu(v + i) - vm;
                     acc = at::vec::fmadd(d, d, acc);
                   }
                   float t = lane_sum(acc);
                   for (int64_t i = nv; i < len; ++i) t += (v[i] - mean) * (v[i] - mean);
                   total += t;
                 });
  return total;
}

void channel_affine(const void* in, void* out, c10::ScalarType dtype, int64_t nb, int64_t channels,
                    int64_t s, int64_t c, float a, float b) {
  float buf[kBlock];
  const int64_t es = element_size(dtype);
  const FVec va(a), vb(b);
  for_each_block(
      in, dtype, nb, channels, s, c, buf, [&](int64_t n, int64_t o, float* v, int64_t len) {
        const int64_t nv = len - len % FVec::size();
        for (int64_t i = 0; i < nv; i += FVec::size()) {
          at::vec::fmadd(FVec::loadu(v + i), va, vb).store(v + i);
        }
        for (int64_t i = nv; i < len; ++i) v[i] = v[i] * a + b;
        narrow(v, static_cast<char*>(out) + ((n * channels + c) * s + o) * es, dtype, len);
      });
}

void channel_backward_sums(const void* dy, const void* x, c10::ScalarType dtype, int64_t nb,
                           int64_t channels, int64_t s, int64_t c, float mean, double* sum_dy,
                           double* sum_dy_dev) {
  float xb[kBlock], gb[kBlock];
  const int64_t es = element_size(dtype);
  const FVec vm(mean);
  double s1 = 0, s2 = 0;
  for_each_block(
      x, dtype, nb, channels, s, c, xb, [&](int64_t n, int64_t o, const float* v, int64_t len) {
        widen(static_cast<const char*>(dy) + ((n * channels + c) * s + o) * es, dtype, gb, len);
        const int64_t nv = len - len % FVec::size();
        FVec a1(0.f), a2(0.f);
        for (int64_t i = 0; i < nv; i += FVec::size()) {
          const FVec g = FVec::loadu(gb + i);
          a1 = a1 + g;
          a2 = at::vec::fmadd(g, FVec::loadu(v + i) - vm, a2);
        }
        float t1 = lane_sum(a1), t2 = lane_sum(a2);
        for (int64_t i = nv; i < len; ++i) {
          t1 += gb[i];
          t2 += gb[i] * (v[i] - mean);
        }
        s1 += t1;
        s2 += t2;
      });
  *sum_dy = s1;
  *sum_dy_dev = s2;
}

void channel_backward_dx(const void* dy, const void* x, void* dx, c10::ScalarType dtype, int64_t nb,
                         int64_t channels, int64_t s, int64_t c, float k, float p, float q) {
  float xb[kBlock], gb[kBlock];
  const int64_t es = element_size(dtype);
  const FVec vk(k), vp(p), vq(q);
  for_each_block(
      x, dtype, nb, channels, s, c, xb, [&](int64_t n, int64_t o, float* v, int64_t len) {
        const int64_t off = ((n * channels + c) * s + o) * es;
        widen(static_cast<const char*>(dy) + off, dtype, gb, len);
        const int64_t nv = len - len % FVec::size();
        for (int64_t i = 0; i < nv; i += FVec::size()) {
          at::vec::fmadd(FVec::loadu(gb + i), vk, at::vec::fmadd(FVec::loadu(v + i), vp, vq))
              .store(v + i);
        }
        for (int64_t i = nv; i < len; ++i) v[i] = gb[i] * k + (v[i] * p + q);
        narrow(v, static_cast<char*>(dx) + off, dtype, len);
      });
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace detail
}  // namespace ampx
