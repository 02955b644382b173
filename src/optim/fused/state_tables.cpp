// The tables of the moments in fewer bits on the CPU (state_tiles.h: the
// 8-bit state's dynamic tree maps of state_codes.h and their codes by
// bucket), the codecs of the best build, and the tests' hooks
// (ampx/detail/optim_state.h).
//
// bitsandbytes' map (Dettmers 2015, "8-Bit Approximations for Parallelism in
// Deep Learning"; torchao's create_dynamic_map(signed, 7, 8)): for each
// decade i = 0..6, the midpoints of n equal steps from 0.1 to 1 times
// 10^(i - 6), n = 2^i (signed, both signs) or 2^(i + 1) (unsigned); then 0
// and 1. torchao takes the steps from torch.linspace in float32, whose
// roundings follow the CPU's vector width; here each value is computed in
// double and rounded to float32 once, the same on every machine
// (tests/optim/optim_state_test.cpp compares the two).

#include "state_tiles.h"

#include "ampx/detail/cpu_isa.h"
#include "ampx/detail/optim_state.h"

#include "state_codes.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
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
namespace cpu = ::ampx::detail::cpu;
using ::ampx::detail::bits_float;

/// The float of bucket b whose key (map_bucket_code's) is `key`.
float bucket_float(uint32_t b, uint32_t key) {
  const uint32_t flip = (b & 0x8000u) ? 0xFFFFu : 0u;
  return bits_float((b << 16) | (key ^ flip));
}

/// map_buckets' entry of bucket b: the codes of its floats are
/// nondecreasing in the key (map_code's search and tie rule are monotone in
/// x), so a binary search finds where they step up.
uint32_t bucket_entry(const math::StateMap& map, uint32_t b) {
  // The bucket's non-NaN keys: all; +inf's bucket key 0 only (then NaNs),
  // -inf's key 0xFFFF only; none in a bucket of NaNs alone.
  uint32_t lo = 0, hi = 0xFFFFu;
  const uint32_t exponent = (b >> 7) & 0xFFu, top = b & 0x7Fu;
  if (exponent == 0xFFu) {
    if (top != 0) return 0u | (0x10000u << 8);  // NaN: the codec's own case
    if (b & 0x8000u)
      lo = 0xFFFFu;
    else
      hi = 0;
  }
  const uint32_t c_lo = math::map_code(map, bucket_float(b, lo));
  const uint32_t c_hi = math::map_code(map, bucket_float(b, hi));
  TORCH_INTERNAL_ASSERT(c_hi == c_lo || c_hi == c_lo + 1, "ampx::optim: bucket ", b,
                        " spans codes ", c_lo, " to ", c_hi, " of the 8-bit map");
  if (c_hi == c_lo) return c_lo | (0x10000u << 8);
  while (hi - lo > 1) {  // code(lo) == c_lo, code(hi) == c_hi
    const uint32_t mid = lo + (hi - lo) / 2;
    (math::map_code(map, bucket_float(b, mid)) == c_lo ? lo : hi) = mid;
  }
  return c_lo | (hi << 8);
}

struct MapBuckets {
  std::vector<uint32_t> entry;
  explicit MapBuckets(const math::StateMap& map) : entry(1u << 16) {
    for (uint32_t b = 0; b < (1u << 16); ++b) entry[b] = bucket_entry(map, b);
  }
};

cpu::Isa codec_isa() {
  static const cpu::Isa isa = cpu::best_isa();
  return isa;
}

}  // namespace

const float* dynamic_map_table(bool is_signed) {
  return math::dynamic_map(is_signed).value;
}

const uint32_t* map_buckets(bool is_signed) {
  static const MapBuckets kSigned(math::dynamic_map(true));
  static const MapBuckets kUnsigned(math::dynamic_map(false));
  return (is_signed ? kSigned : kUnsigned).entry.data();
}

void decode_moment(const FusedParam& p, int moment, int64_t b, int64_t n, float* out) {
  cpu::state_codecs_for(codec_isa()).decode(p, moment, b, n, out);
}

void encode_moment(const FusedParam& p, uint64_t key, int moment, int64_t b, int64_t n,
                   const float* in) {
  cpu::state_codecs_for(codec_isa()).encode(p, key, moment, b, n, in);
}

std::vector<float> state_dynamic_map(bool is_signed) {
  const auto& map = math::dynamic_map(is_signed);
  return {map.value, map.value + 256};
}

uint8_t state_dynamic_code(bool is_signed, float x) {
  if (x != x) return 0;
  const uint32_t u = ::ampx::detail::float_bits(x);
  return static_cast<uint8_t>(math::map_bucket_code(map_buckets(is_signed)[u >> 16], u));
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

namespace {

/// A param of n elements, one tile, whose codes the hooks below point at.
FusedParam hook_param(StateCodec codec, int moment, int64_t index_base) {
  FusedParam p;
  p.state_format = codec == StateCodec::kBf16  ? FusedState::kBf16
                   : codec == StateCodec::kFp8 ? FusedState::kFp8
                                               : FusedState::kInt8;
  p.state_block = static_cast<int32_t>(kMaxStateBlock);
  p.index_base = index_base;
  TORCH_CHECK(moment == 0 || moment == 1, "ampx::optim: moment ", moment);
  return p;
}

void point_codes(FusedParam& p, int moment, void* codes, float* scale) {
  (moment == 0 ? p.exp_avg_codes : p.exp_avg_sq_codes) = codes;
  (moment == 0 ? p.exp_avg_scale : p.exp_avg_sq_scale) = scale;
}

}  // namespace

void state_encode(cpu::Isa isa, StateCodec codec, int moment, uint64_t key, int64_t index_base,
                  const float* in, int64_t n, void* codes, float* scale) {
  TORCH_CHECK(codec == StateCodec::kBf16 || n <= kMaxStateBlock, "ampx::optim: a block of ", n);
  FusedParam p = hook_param(codec, moment, index_base);
  point_codes(p, moment, codes, scale);
  cpu::state_codecs_for(isa).encode(p, key, moment, 0, n, in);
}

void state_decode(cpu::Isa isa, StateCodec codec, int moment, const void* codes, float scale,
                  int64_t n, float* out) {
  FusedParam p = hook_param(codec, moment, 0);
  point_codes(p, moment, const_cast<void*>(codes), &scale);
  cpu::state_codecs_for(isa).decode(p, moment, 0, n, out);
}

void kahan_read(cpu::Isa isa, bool bf16, const uint16_t* param, const uint16_t* comp, int64_t n,
                float* w) {
  FusedParam p;
  p.dtype = bf16 ? FusedDtype::kBFloat16 : FusedDtype::kHalf;
  p.param = const_cast<uint16_t*>(param);
  p.compensation = const_cast<uint16_t*>(comp);
  cpu::state_codecs_for(isa).read_kahan(p, 0, n, w);
}

void kahan_write(cpu::Isa isa, bool bf16, const uint16_t* param, const float* w, int64_t n,
                 uint16_t* comp) {
  FusedParam p;
  p.dtype = bf16 ? FusedDtype::kBFloat16 : FusedDtype::kHalf;
  p.param = const_cast<uint16_t*>(param);
  p.compensation = comp;
  cpu::state_codecs_for(isa).write_compensation(p, 0, n, w);
}

}  // namespace detail
}  // namespace optim
}  // namespace ampx
