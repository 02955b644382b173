// The fused step's state codecs (bf16, FP8 and 8-bit moments, Kahan
// weights), as each instruction-set build runs them, against a scalar
// reference written here from the formats' definitions
// (docs/optimizer-state.md): every build must write the same bits, so that
// a checkpoint does not depend on the CPU that wrote it. Random and edge
// inputs: zeros of both signs, subnormals, ties between codes, a block with
// one huge value, infinities and NaNs, tiles that start off a multiple of 4.

#include "../test_util.h"
#include "ampx/detail/cpu_isa.h"
#include "ampx/detail/optim_state.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {
namespace codecs_test {  // (unity builds: apart from the other tests' helpers)

namespace aopt = ampx::optim;
using ampx::detail::cpu::Isa;
using ampx::test::from_bits;
using ampx::test::to_bits;
using aopt::detail::StateCodec;

// ---- the reference ---------------------------------------------------------------

uint64_t mix64(uint64_t z) {  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// bf16 moments: the 16 random bits of element i of moment `moment`'s
/// stream (one hash for four elements), added below the kept 16 bits.
uint16_t ref_bf16(float x, uint64_t key, int moment, int64_t i) {
  const uint64_t stream =
      mix64(key ^ (moment == 0 ? 0x6a09e667f3bcc909ULL : 0xbb67ae8584caa73bULL));
  const uint64_t h = mix64(stream + static_cast<uint64_t>(i >> 2) * 0x9e3779b97f4a7c15ULL);
  const uint32_t random = static_cast<uint32_t>(h >> (16 * (i & 3))) & 0xFFFFu;
  const uint32_t u = to_bits(x);
  if ((u & 0x7F800000u) == 0x7F800000u) return (u & 0x7FFFFFu) ? 0x7FC0 : u >> 16;
  return static_cast<uint16_t>((u + random) >> 16);
}

/// float8_e4m3fn's value of code c (0x7F, 0xFF: NaN).
float e4m3_value(int c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  if ((c & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                         : std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
  return (c & 0x80) ? -v : v;
}

/// The E4M3 code of q: the nearest of the 127 magnitudes (ties to the even
/// code), saturated at 448, NaN as 0x7F with q's sign.
uint8_t ref_e4m3(float q) {
  const uint8_t sign = std::signbit(q) ? 0x80 : 0;
  if (std::isnan(q)) return sign | 0x7F;
  const double a = std::fabs(static_cast<double>(q));
  int best = 0;
  for (int c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(a - e4m3_value(c)), d_best = std::fabs(a - e4m3_value(best));
    if (d < d_best || (d == d_best && (c & 1) == 0)) best = c;
  }
  return sign | static_cast<uint8_t>(a >= 448.0 ? 0x7E : best);
}

/// The block's absmax, NaN where any is NaN, floored at 1e-12.
float ref_floored_absmax(const std::vector<float>& x) {
  float a = 0.f;
  for (float v : x) {
    if (std::isnan(v)) return 1e-12f;  // NaN > 1e-12 is false: the floor
    a = std::max(a, std::fabs(v));
  }
  return a > 1e-12f ? a : 1e-12f;
}

/// One block: its scale and codes in format `codec` (FP8: E4M3 of x / s,
/// s = absmax / 448; 8-bit: the map's code of x / s, s = absmax; in both,
/// a positive second moment at least code 1).
float ref_block(StateCodec codec, int moment, const std::vector<float>& x,
                std::vector<uint8_t>& codes) {
  const float absmax = ref_floored_absmax(x);
  const float scale = codec == StateCodec::kFp8 ? absmax / 448.0f : absmax;
  const auto map = aopt::detail::state_dynamic_map(moment == 0);
  codes.resize(x.size());
  for (size_t k = 0; k < x.size(); ++k) {
    const float q = x[k] / scale;
    codes[k] =
        codec == StateCodec::kFp8 ? ref_e4m3(q) : aopt::detail::state_map_code(map.data(), q);
    // A positive second moment never codes to zero (code 1 instead: FP8's
    // smallest subnormal, the 8-bit map's smallest value).
    if (moment == 1 && q > 0 && codes[k] == 0) codes[k] = 1;
  }
  return scale;
}

// ---- inputs ----------------------------------------------------------------------

/// Blocks of random and edge values; `fill` picks each block's kind.
std::vector<float> edge_block(int kind, int64_t n, std::mt19937& rng) {
  std::vector<float> x(static_cast<size_t>(n));
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<uint32_t> bits;
  const auto map = aopt::detail::state_dynamic_map(kind % 2 == 0);
  for (int64_t k = 0; k < n; ++k) {
    float& v = x[static_cast<size_t>(k)];
    switch (kind) {
      case 0:
        v = normal(rng) * 1e-3f;
        break;  // random
      case 1:
        v = from_bits(bits(rng));
        break;  // any bits, NaN included
      case 2:
        v = k % 2 ? 0.0f : -0.0f;
        break;  // zeros
      case 3:
        v = from_bits((bits(rng) & 0x807FFFFFu));
        break;  // subnormals
      case 4:
        v = k == 7 ? 3e38f : normal(rng);
        break;  // one huge value
      case 5:
        v = k == 0 ? 448.0f : (e4m3_value(k % 126) + e4m3_value(k % 126 + 1)) / 2;
        break;
      case 6: {  // 8-bit ties (scale 1)
        const size_t c = static_cast<size_t>(k) % 255;
        const float mid = (map[c] + map[c + 1]) / 2;
        v = k == 0 ? 1.0f : k % 3 == 0 ? mid : std::nextafter(mid, k % 3 == 1 ? 2.f : -2.f);
        break;
      }
      case 7:
        v = k % 5 == 0 ? std::numeric_limits<float>::infinity() : normal(rng);
        break;
      default:
        v = normal(rng) * 1e-30f;  // quotients near the maps' smallest values
    }
  }
  return x;
}
constexpr int kKinds = 9;

std::string isa_label(Isa isa) {
  return ampx::detail::cpu::isa_name(isa);
}

TEST(OptimStateCodecsTest, Bf16MomentsAreTheReferencesOnEveryBuild) {
  std::mt19937 rng(1);
  for (const Isa isa : ampx::detail::cpu::supported_isas()) {
    for (int kind = 0; kind < kKinds; ++kind) {
      for (const int64_t start : {0, 1, 3, 1026}) {  // the tile's first index
        const int64_t n = 1024 - start % 7;
        const auto x = edge_block(kind, n, rng);
        const int moment = kind % 2;
        const uint64_t key = 0x1234567890abcdefULL + static_cast<uint64_t>(kind);
        std::vector<uint16_t> codes(x.size());
        aopt::detail::state_encode(isa, StateCodec::kBf16, moment, key, start, x.data(), n,
                                   codes.data(), nullptr);
        std::vector<float> back(x.size());
        aopt::detail::state_decode(isa, StateCodec::kBf16, moment, codes.data(), 1.f, n,
                                   back.data());
        int64_t differ = 0, differ_back = 0;
        for (int64_t k = 0; k < n; ++k) {
          differ += codes[k] != ref_bf16(x[k], key, moment, start + k);
          differ_back += to_bits(back[k]) != static_cast<uint32_t>(codes[k]) << 16;
        }
        EXPECT_EQ(differ, 0) << isa_label(isa) << " kind " << kind << " start " << start;
        EXPECT_EQ(differ_back, 0) << isa_label(isa) << " kind " << kind;
      }
    }
  }
}

TEST(OptimStateCodecsTest, Fp8And8BitBlocksAreTheReferencesOnEveryBuild) {
  std::mt19937 rng(2);
  for (const Isa isa : ampx::detail::cpu::supported_isas()) {
    for (const StateCodec codec : {StateCodec::kFp8, StateCodec::kInt8}) {
      for (int kind = 0; kind < kKinds; ++kind) {
        for (const int moment : {0, 1}) {
          const int64_t n = kind == 3 ? 37 : 256 + kind;  // vector bodies and tails
          auto x = edge_block(kind, n, rng);
          if (moment == 1 && kind != 1) {
            for (float& v : x) v = std::fabs(v);  // second moments: >= 0
          }
          std::vector<uint8_t> want, codes(x.size());
          const float want_scale = ref_block(codec, moment, x, want);
          float scale = -1.f;
          aopt::detail::state_encode(isa, codec, moment, 0, 0, x.data(), n, codes.data(), &scale);
          const std::string at = isa_label(isa) + (codec == StateCodec::kFp8 ? " fp8" : " 8bit") +
                                 " kind " + std::to_string(kind) + " moment " +
                                 std::to_string(moment);
          EXPECT_EQ(to_bits(scale), to_bits(want_scale)) << at;
          int64_t differ = 0;
          for (int64_t k = 0; k < n; ++k) differ += codes[k] != want[k];
          EXPECT_EQ(differ, 0) << at;
          // Decoding: the table's value times the scale, NaN codes as NaN.
          std::vector<float> back(x.size());
          aopt::detail::state_decode(isa, codec, moment, codes.data(), scale, n, back.data());
          const auto map = aopt::detail::state_dynamic_map(moment == 0);
          int64_t differ_back = 0;
          for (int64_t k = 0; k < n; ++k) {
            const float v = codec == StateCodec::kFp8 ? e4m3_value(codes[k]) : map[codes[k]];
            const float want_v = v * scale;
            differ_back +=
                std::isnan(want_v) ? !std::isnan(back[k]) : to_bits(back[k]) != to_bits(want_v);
          }
          EXPECT_EQ(differ_back, 0) << at;
        }
      }
    }
  }
}

TEST(OptimStateCodecsTest, EveryFp8QuotientAndEveryBucketOfThe8BitMapCodesAsTheReference) {
  // Each 16-bit prefix of a float (the 8-bit codes' bucket) with several low
  // halves, in blocks whose absmax is 1 (8-bit) or 448 (FP8): quotients are
  // the values themselves.
  for (const Isa isa : ampx::detail::cpu::supported_isas()) {
    for (const StateCodec codec : {StateCodec::kFp8, StateCodec::kInt8}) {
      for (const int moment : {0, 1}) {
        const float top = codec == StateCodec::kFp8 ? 448.f : 1.f;
        int64_t differ = 0;
        for (uint32_t b = 0; b < (1u << 16); b += 255) {
          std::vector<float> x = {top};
          for (uint32_t b2 = b; b2 < std::min(b + 255, 1u << 16); ++b2) {
            for (uint32_t low : {0u, 1u, 0x7FFFu, 0x8000u, 0xFFFEu, 0xFFFFu}) {
              const float v = from_bits((b2 << 16) | low);
              if (std::fabs(v) <= top) x.push_back(v);
            }
          }
          std::vector<uint8_t> want, codes(x.size());
          ref_block(codec, moment, x, want);
          float scale;
          aopt::detail::state_encode(isa, codec, moment, 0, 0, x.data(),
                                     static_cast<int64_t>(x.size()), codes.data(), &scale);
          for (size_t k = 0; k < x.size(); ++k) differ += codes[k] != want[k];
        }
        EXPECT_EQ(differ, 0) << isa_label(isa) << " moment " << moment;
      }
    }
  }
}

TEST(OptimStateCodecsTest, EveryCodeDecodesToItsValueTimesTheBlocksScale) {
  // All 256 codes (twice, and a tail past the vector bodies) at scales from
  // the floor's (1e-12 / 448) to near float's largest: FP8 from the code's
  // fields, 8-bit from the map, each the reference's value times the scale.
  std::vector<uint8_t> codes(256 * 2 + 13);
  for (size_t k = 0; k < codes.size(); ++k) codes[k] = static_cast<uint8_t>(k * 37 % 256);
  const auto n = static_cast<int64_t>(codes.size());
  for (const Isa isa : ampx::detail::cpu::supported_isas()) {
    for (const StateCodec codec : {StateCodec::kFp8, StateCodec::kInt8}) {
      for (const int moment : {0, 1}) {
        const auto map = aopt::detail::state_dynamic_map(moment == 0);
        for (const float scale : {1.0f, 1e-12f / 448.0f, 0.3f, 7.5e-4f, 3e35f}) {
          std::vector<float> back(codes.size());
          aopt::detail::state_decode(isa, codec, moment, codes.data(), scale, n, back.data());
          int64_t differ = 0;
          for (int64_t k = 0; k < n; ++k) {
            const uint8_t c = codes[static_cast<size_t>(k)];
            const float want = (codec == StateCodec::kFp8 ? e4m3_value(c) : map[c]) * scale;
            differ += std::isnan(want) ? !std::isnan(back[k]) : to_bits(back[k]) != to_bits(want);
          }
          EXPECT_EQ(differ, 0) << isa_label(isa) << (codec == StateCodec::kFp8 ? " fp8" : " 8bit")
                               << " moment " << moment << " scale " << scale;
        }
      }
    }
  }
}

TEST(OptimStateCodecsTest, KahanWeightsAreTheReferencesOnEveryBuild) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits;
  for (const Isa isa : ampx::detail::cpu::supported_isas()) {
    for (const bool bf16 : {true, false}) {
      const int64_t n = 1000 + (bf16 ? 3 : 5);
      std::vector<uint16_t> param(n), comp(n);
      std::vector<float> w(n), want_w(n);
      for (int64_t k = 0; k < n; ++k) {
        param[k] = static_cast<uint16_t>(bits(rng));
        comp[k] = static_cast<uint16_t>(k % 3 == 0 ? bits(rng) & 0x807F : bits(rng));
        const auto value = [bf16](uint16_t h) {
          return bf16 ? static_cast<float>(c10::BFloat16(h, c10::BFloat16::from_bits()))
                      : static_cast<float>(c10::Half(h, c10::Half::from_bits()));
        };
        want_w[k] = value(param[k]) + value(comp[k]);
      }
      aopt::detail::kahan_read(isa, bf16, param.data(), comp.data(), n, w.data());
      // The new weight: the old one moved a little, or any bits (NaN, inf, subnormal).
      std::vector<uint16_t> out(n);
      for (int64_t k = 0; k < n; ++k) {
        const bool nan = std::isnan(want_w[k]);
        EXPECT_TRUE(nan ? std::isnan(w[k]) : to_bits(w[k]) == to_bits(want_w[k]))
            << isa_label(isa) << " element " << k;
        w[k] = k % 4 == 0 ? from_bits(bits(rng)) : w[k] * 1.001f + 1e-6f;
      }
      aopt::detail::kahan_write(isa, bf16, param.data(), w.data(), n, out.data());
      int64_t differ = 0;
      for (int64_t k = 0; k < n; ++k) {
        const float pv =
            bf16 ? static_cast<float>(c10::BFloat16(param[k], c10::BFloat16::from_bits()))
                 : static_cast<float>(c10::Half(param[k], c10::Half::from_bits()));
        const float d = w[k] - pv;
        const uint16_t want = bf16 ? c10::BFloat16(d).x : c10::Half(d).x;
        differ += out[k] != want;
      }
      EXPECT_EQ(differ, 0) << isa_label(isa) << (bf16 ? " bf16" : " fp16");
    }
  }
}

}  // namespace codecs_test
}  // namespace
