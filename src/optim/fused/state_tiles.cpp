// The moments in fewer bits on the CPU (state_tiles.h), and the 8-bit
// state's dynamic tree maps (state_codes.h).
//
// bitsandbytes' map (Dettmers 2015, "8-Bit Approximations for Parallelism in
// Deep Learning"; torchao's create_dynamic_map(signed, 7, 8)): for each
// decade i = 0..6, the midpoints of n equal steps from 0.1 to 1 times
// 10^(i - 6), n = 2^i (signed, both signs) or 2^(i + 1) (unsigned); then 0
// and 1. torchao takes the steps from torch.linspace in float32, whose
// roundings follow the CPU's vector width; here each value is computed in
// double and rounded to float32 once, the same on every machine
// (tests/optim_state_test.cpp compares the two).

#include "state_tiles.h"

#include "ampx/detail/optim_state.h"

#include "state_codes.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace ampx {
namespace detail {
namespace math {
namespace {

StateMap make_dynamic_map(bool is_signed) {
  std::vector<float> values;
  for (int i = 0; i < 7; ++i) {
    const int n = is_signed ? (1 << i) : (1 << (i + 1));
    const double decade = std::pow(10.0, i - 6);
    for (int j = 0; j < n; ++j) {
      const double low = 0.1 + 0.9 * j / n, high = 0.1 + 0.9 * (j + 1) / n;
      const double mean = (low + high) / 2.0 * decade;
      values.push_back(static_cast<float>(mean));
      if (is_signed) values.push_back(static_cast<float>(-mean));
    }
  }
  values.push_back(0.0f);
  values.push_back(1.0f);
  std::sort(values.begin(), values.end());
  StateMap map;
  std::copy(values.begin(), values.end(), map.value);
  return map;
}

}  // namespace

const StateMap& dynamic_map(bool is_signed) {
  static const StateMap kSigned = make_dynamic_map(true);
  static const StateMap kUnsigned = make_dynamic_map(false);
  return is_signed ? kSigned : kUnsigned;
}

}  // namespace math
}  // namespace detail

namespace optim {
namespace detail {
namespace {

namespace math = ::ampx::detail::math;

/// map_code's answer without its binary search, for one of the dynamic maps:
/// floats are cut into buckets by their top 16 bits (sign, exponent, 7
/// mantissa bits); a bucket's entry is map_floor of the bucket's smallest
/// value, from which map_floor of any x in it is at most one step up (no
/// bucket holds two map values above its smallest: checked when the table
/// is made). Then map_round. The same code as map_code for every float
/// (OptimStateTest.FastCodesAreTheBinarySearchsForEveryFloat16Prefix).
struct MapCodes {
  const math::StateMap* map;
  std::vector<uint8_t> start;  // per bucket

  explicit MapCodes(const math::StateMap& m) : map(&m), start(1 << 16) {
    for (uint32_t b = 0; b < (1u << 16); ++b) {
      // The bucket's smallest value: the most negative of a negative bucket.
      const bool negative = (b & 0x8000u) != 0;
      const float low = ::ampx::detail::bits_float((b << 16) | (negative ? 0xFFFFu : 0u));
      const float high = ::ampx::detail::bits_float((b << 16) | (negative ? 0u : 0xFFFFu));
      const int c = math::map_floor(m, low);
      if (low == low) {
        int inside = 0;  // map values in (low, high]
        for (int k = c + 1; k < 256 && m.value[k] <= high; ++k) ++inside;
        TORCH_INTERNAL_ASSERT(inside <= 1, "ampx::optim: bucket ", b, " holds ", inside,
                              " values of the 8-bit map");
      }
      start[b] = static_cast<uint8_t>(c);
    }
  }

  uint8_t operator()(float x) const {
    if (x != x) return 0;  // NaN: every comparison of the search fails
    int c = start[::ampx::detail::float_bits(x) >> 16];
    c += (c < 255 && x >= map->value[c + 1]) ? 1 : 0;
    return math::map_round(*map, c, x);
  }
};

const MapCodes& map_codes(bool is_signed) {
  static const MapCodes kSigned(math::dynamic_map(true));
  static const MapCodes kUnsigned(math::dynamic_map(false));
  return is_signed ? kSigned : kUnsigned;
}

/// The 256 E4M3 codes' values (scale 1).
const std::vector<float>& e4m3_values() {
  static const std::vector<float> values = [] {
    std::vector<float> v(256);
    for (int c = 0; c < 256; ++c) v[c] = math::fp8_state_value(static_cast<uint8_t>(c), 1.0f);
    return v;
  }();
  return values;
}

float* scales_of(const FusedParam& p, int moment) {
  return moment == 0 ? p.exp_avg_scale : p.exp_avg_sq_scale;
}

/// The largest |x| of x[0, n); NaN where any is NaN (as torch's amax).
/// Branchless, so that it vectorizes.
float absmax_of(const float* x, int64_t n) {
  float a = 0.f;
  bool nan = false;
  for (int64_t k = 0; k < n; ++k) {
    const float y = std::fabs(x[k]);
    nan |= y != y;
    a = y > a ? y : a;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : a;
}

template <class T>
void read_kahan(const FusedParam& p, int64_t b, int64_t n, float* w) {
  const T* param = static_cast<const T*>(p.param) + b;
  const T* comp = static_cast<const T*>(p.compensation) + b;
  for (int64_t k = 0; k < n; ++k) w[k] = static_cast<float>(param[k]) + static_cast<float>(comp[k]);
}

template <class T>
void write_kahan(const FusedParam& p, int64_t b, int64_t n, const float* w) {
  const T* param = static_cast<const T*>(p.param) + b;
  T* comp = static_cast<T*>(p.compensation) + b;
  for (int64_t k = 0; k < n; ++k) comp[k] = static_cast<T>(w[k] - static_cast<float>(param[k]));
}

}  // namespace

void decode_moment(const FusedParam& p, int moment, int64_t b, int64_t n, float* out) {
  const void* codes = moment == 0 ? p.exp_avg_codes : p.exp_avg_sq_codes;
  switch (p.state_format) {
    case FusedState::kBf16: {
      const auto* c = static_cast<const uint16_t*>(codes) + b;
      for (int64_t k = 0; k < n; ++k) out[k] = math::bf16_state_value(c[k]);
      return;
    }
    case FusedState::kFp8: {
      const auto* c = static_cast<const uint8_t*>(codes) + b;
      const float scale = scales_of(p, moment)[b / p.state_block];
      const float* value = e4m3_values().data();  // fp8_state_value(code, 1), exact
      for (int64_t k = 0; k < n; ++k) out[k] = value[c[k]] * scale;
      return;
    }
    case FusedState::kInt8: {
      const auto* c = static_cast<const uint8_t*>(codes) + b;
      const float scale = scales_of(p, moment)[b / p.state_block];
      const float* map = math::dynamic_map(moment == 0).value;
      for (int64_t k = 0; k < n; ++k) out[k] = map[c[k]] * scale;
      return;
    }
    case FusedState::kFp32:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "ampx::optim: fp32 moments are not decoded");
}

void encode_moment(const FusedParam& p, uint64_t key, int moment, int64_t b, int64_t n,
                   const float* in) {
  void* codes = moment == 0 ? p.exp_avg_codes : p.exp_avg_sq_codes;
  switch (p.state_format) {
    case FusedState::kBf16: {
      auto* c = static_cast<uint16_t*>(codes) + b;
      const uint64_t stream = math::state_key(key, moment);
      // 16 bits an element: one hash of (stream, index / 4) for four.
      uint64_t h = 0;
      for (int64_t k = 0; k < n; ++k) {
        const int64_t index = p.index_base + b + k;
        if (k == 0 || (index & 3) == 0) {
          h = math::mix64(stream + static_cast<uint64_t>(index >> 2) * 0x9e3779b97f4a7c15ULL);
        }
        c[k] =
            math::bf16_state_bits(in[k], static_cast<uint32_t>(h >> (16 * (index & 3))) & 0xFFFFu);
      }
      return;
    }
    case FusedState::kFp8: {
      auto* c = static_cast<uint8_t*>(codes) + b;
      const float scale = math::fp8_state_scale(absmax_of(in, n));
      scales_of(p, moment)[b / p.state_block] = scale;
      float x[kMaxStateBlock];  // the quotients first: that loop vectorizes
      for (int64_t k = 0; k < n; ++k) x[k] = in[k] / scale;
      for (int64_t k = 0; k < n; ++k) c[k] = math::fp8_state_code(x[k]);
      return;
    }
    case FusedState::kInt8: {
      auto* c = static_cast<uint8_t*>(codes) + b;
      const float scale = math::floored_absmax(absmax_of(in, n));
      scales_of(p, moment)[b / p.state_block] = scale;
      const auto& codes_of = map_codes(moment == 0);
      float x[kMaxStateBlock];  // the quotients first: that loop vectorizes
      for (int64_t k = 0; k < n; ++k) x[k] = in[k] / scale;
      for (int64_t k = 0; k < n; ++k) c[k] = codes_of(x[k]);
      return;
    }
    case FusedState::kFp32:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "ampx::optim: fp32 moments are not encoded");
}

void read_kahan_weight(const FusedParam& p, int64_t b, int64_t n, float* w) {
  if (p.dtype == FusedDtype::kBFloat16) {
    read_kahan<c10::BFloat16>(p, b, n, w);
  } else {
    read_kahan<c10::Half>(p, b, n, w);
  }
}

void write_compensation(const FusedParam& p, int64_t b, int64_t n, const float* w) {
  if (p.dtype == FusedDtype::kBFloat16) {
    write_kahan<c10::BFloat16>(p, b, n, w);
  } else {
    write_kahan<c10::Half>(p, b, n, w);
  }
}

std::vector<float> state_dynamic_map(bool is_signed) {
  const auto& map = math::dynamic_map(is_signed);
  return {map.value, map.value + 256};
}

uint8_t state_dynamic_code(bool is_signed, float x) {
  return map_codes(is_signed)(x);
}

uint8_t state_map_code(const float* map, float x) {
  math::StateMap m;
  std::copy(map, map + 256, m.value);
  return math::map_code(m, x);
}

void fp8_state_quantize(const std::vector<float>& in, int64_t block, std::vector<float>& scales,
                        std::vector<uint8_t>& codes) {
  const auto n = static_cast<int64_t>(in.size());
  scales.assign(static_cast<size_t>((n + block - 1) / block), 0.f);
  codes.assign(in.size(), 0);
  FusedParam p;
  p.state_format = FusedState::kFp8;
  p.state_block = static_cast<int32_t>(block);
  p.exp_avg_codes = codes.data();
  p.exp_avg_scale = scales.data();
  for (int64_t b = 0; b < n; b += block) {
    encode_moment(p, 0, 0, b, std::min(block, n - b), in.data() + b);
  }
}

}  // namespace detail
}  // namespace optim
}  // namespace ampx
