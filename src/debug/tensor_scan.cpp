#include "tensor_scan.h"
#include "../kernels/function_args.h"

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace ampx {
namespace debug {
namespace detail {
namespace {

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kExpMask = 0x7f800000u;

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// |x| as float32 bits, for each element type the scans read.
inline uint32_t abs_bits(float x) {
  return bits_of(x) & kAbsMask;
}
inline uint32_t abs_bits(c10::BFloat16 x) {
  return (static_cast<uint32_t>(x.x) << 16) & kAbsMask;
}
inline uint32_t abs_bits(c10::Half x) {
  return bits_of(static_cast<float>(x)) & kAbsMask;
}
inline uint32_t abs_bits(double x) {
  return bits_of(static_cast<float>(x)) & kAbsMask;
}

inline bool is_nan(float x) {
  return std::isnan(x);
}
inline bool is_nan(double x) {
  return std::isnan(x);
}
inline bool is_nan(c10::BFloat16 x) {
  return std::isnan(static_cast<float>(x));
}
inline bool is_nan(c10::Half x) {
  return std::isnan(static_cast<float>(x));
}
template <typename T>
inline double to_double(T x) {
  return static_cast<double>(static_cast<float>(x));
}
inline double to_double(double x) {
  return x;
}

template <typename T>
inline bool is_finite(T x) {
  return std::isfinite(static_cast<double>(static_cast<float>(x)));
}
inline bool is_finite(double x) {
  return std::isfinite(x);
}

at::Tensor host_contiguous(const at::Tensor& t) {
  auto host = t.device().is_cpu() ? t : t.to(at::kCPU);
  return host.contiguous();
}

template <typename F>
void dispatch_floating(const at::Tensor& t, const char* what, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return f(t.data_ptr<float>());
    case at::kDouble:
      return f(t.data_ptr<double>());
    case at::kHalf:
      return f(t.data_ptr<c10::Half>());
    case at::kBFloat16:
      return f(t.data_ptr<c10::BFloat16>());
    default:
      TORCH_CHECK(false, what, ": expected a float32, float64, float16 or bfloat16 tensor, got ",
                  t.scalar_type());
  }
}

// Non-finite test on the bits (all exponent bits set), so that the loops
// vectorize; double through std::isfinite.
inline bool non_finite(float x) {
  return (bits_of(x) & kExpMask) == kExpMask;
}
inline bool non_finite(c10::BFloat16 x) {
  return (x.x & 0x7f80u) == 0x7f80u;
}
inline bool non_finite(c10::Half x) {
  return (x.x & 0x7c00u) == 0x7c00u;
}
inline bool non_finite(double x) {
  return !std::isfinite(x);
}

template <typename T>
int64_t count_non_finite(const T* data, int64_t n) {
  std::vector<int64_t> per_thread(at::get_num_threads(), 0);
  at::parallel_for(0, n, ampx::detail::kElementwiseGrain, [&](int64_t begin, int64_t end) {
    int64_t bad = 0;
    for (int64_t i = begin; i < end; ++i) bad += non_finite(data[i]);
    per_thread[at::get_thread_num()] += bad;
  });
  int64_t total = 0;
  for (auto b : per_thread) total += b;
  return total;
}

template <typename T>
void full_finite_scan(const T* data, int64_t n, FiniteScan* out) {
  double abs_max = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T x = data[i];
    if (is_finite(x)) {
      abs_max = std::max(abs_max, std::abs(to_double(x)));
      continue;
    }
    if (is_nan(x)) {
      ++out->nan;
    } else {
      ++out->inf;
    }
    if (out->first_bad < 0) {
      out->first_bad = i;
      out->first_value = to_double(x);
    }
  }
  out->abs_max = abs_max;
}

// ---------------------------------------------------------------- ranges

// Per format: counts of |x| >= bound for three bounds (overflow, beyond the
// zero boundary, normal), as float32 bit patterns of |x|.
struct Bounds {
  std::array<uint32_t, 12> ge{};    // [format * 3 + {0 overflow, 1 above zero, 2 normal}]
  std::array<bool, 256> special{};  // exponent fields holding a bound
};
const Bounds& bounds() {
  static const Bounds b = [] {
    Bounds b;
    for (size_t f = 0; f < kAllFormats.size(); ++f) {
      const auto& lim = format(kAllFormats[f]);
      b.ge[f * 3 + 0] = bits_of(lim.overflow_from) + (lim.overflow_inclusive ? 0 : 1);
      b.ge[f * 3 + 1] = bits_of(lim.zero_up_to) + 1;
      b.ge[f * 3 + 2] = bits_of(lim.normal_from);
    }
    for (auto g : b.ge) b.special[g >> 23] = true;
    return b;
  }();
  return b;
}

struct Partial {
  int64_t zeros = 0;
  int64_t non_finite = 0;
  uint32_t max_bits = 0;
  uint32_t min_bits = std::numeric_limits<uint32_t>::max();
  std::array<int64_t, 256> fields{};    // normal values by exponent field
  std::array<int64_t, 23> subnormal{};  // fp32 subnormals by top mantissa bit
  std::array<int64_t, 12> ge_in_field{};
};

template <typename T>
void range_pass(const T* data, int64_t begin, int64_t end, Partial* p) {
  const auto& b = bounds();
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t u = abs_bits(data[i]);
    if (u == 0) {
      ++p->zeros;
      continue;
    }
    if (u >= kExpMask) {
      ++p->non_finite;
      continue;
    }
    const uint32_t field = u >> 23;
    if (field != 0) {
      ++p->fields[field];
    } else {
      ++p->subnormal[31 - __builtin_clz(u)];
    }
    p->max_bits = std::max(p->max_bits, u);
    p->min_bits = std::min(p->min_bits, u);
    if (b.special[field]) {
      for (size_t k = 0; k < b.ge.size(); ++k) {
        p->ge_in_field[k] += (b.ge[k] >> 23) == field && u >= b.ge[k];
      }
    }
  }
}

RangeRecord finish(const std::vector<Partial>& partials, int64_t numel) {
  Partial t;
  for (const auto& p : partials) {
    t.zeros += p.zeros;
    t.non_finite += p.non_finite;
    t.max_bits = std::max(t.max_bits, p.max_bits);
    t.min_bits = std::min(t.min_bits, p.min_bits);
    for (size_t i = 0; i < t.fields.size(); ++i) t.fields[i] += p.fields[i];
    for (size_t i = 0; i < t.subnormal.size(); ++i) t.subnormal[i] += p.subnormal[i];
    for (size_t i = 0; i < t.ge_in_field.size(); ++i) t.ge_in_field[i] += p.ge_in_field[i];
  }
  RangeRecord r;
  r.calls = 1;
  r.numel = numel;
  r.zeros = t.zeros;
  r.non_finite = t.non_finite;
  if (r.nonzero_finite() > 0) {
    r.abs_max = float_of(t.max_bits);
    r.min_nonzero = float_of(t.min_bits);
  }
  for (int i = 0; i < 23; ++i) r.histogram[i] = t.subnormal[i];
  for (int f = 1; f < 255; ++f) r.histogram[f + 22] = t.fields[f];
  // Count of |x| >= bound: whole fields above the bound's, plus its own field.
  const auto& b = bounds();
  auto count_ge = [&](size_t k) {
    const uint32_t field = b.ge[k] >> 23;
    int64_t n = t.ge_in_field[k];
    for (uint32_t f = std::max<uint32_t>(field + 1, 1); f < 255; ++f) n += t.fields[f];
    return n;
  };
  for (size_t f = 0; f < kAllFormats.size(); ++f) {
    const int64_t overflow = count_ge(f * 3 + 0);
    const int64_t above_zero = count_ge(f * 3 + 1);
    const int64_t normal = count_ge(f * 3 + 2);
    r.formats[f].overflow = overflow;
    r.formats[f].to_zero = r.nonzero_finite() - above_zero;
    r.formats[f].subnormal = above_zero - normal;
  }
  return r;
}

}  // namespace

FiniteScan scan_finite(const at::Tensor& values, bool full) {
  if (!values.device().is_cpu() && !full) {
    // On the device: one reduction and one synchronisation, no copy.
    if (at::isfinite(values).logical_not().sum().item<int64_t>() == 0) return FiniteScan{};
  }
  const auto t = host_contiguous(values);
  FiniteScan out;
  dispatch_floating(t, "ampx::debug (non-finite check)", [&](const auto* data) {
    const int64_t n = t.numel();
    const int64_t bad = count_non_finite(data, n);
    if (bad == 0 && !full) return;
    full_finite_scan(data, n, &out);
  });
  return out;
}

}  // namespace detail

RangeRecord scan_range(const at::Tensor& values) {
  const auto t = detail::host_contiguous(values);
  RangeRecord record;
  detail::dispatch_floating(t, "ampx::debug::scan_range", [&](const auto* data) {
    const int64_t n = t.numel();
    std::vector<detail::Partial> partials(at::get_num_threads());
    at::parallel_for(0, n, ampx::detail::kElementwiseGrain, [&](int64_t begin, int64_t end) {
      detail::range_pass(data, begin, end, &partials[at::get_thread_num()]);
    });
    record = detail::finish(partials, n);
  });
  return record;
}

}  // namespace debug
}  // namespace ampx
