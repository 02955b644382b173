// BlockTensor's loops (ampx/fp8/block.h) on the CPU: quantize (each block's
// amax, its scale by the format's rule, its elements' codes) and the way
// back (block_values, dequantize), and the transpose of 2-D blocks.

#include "ampx/fp8/block.h"

#include "ampx/fp8/cast.h"

#include "../kernels/function_args.h"
#include "block_element_code.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

namespace ampx {
namespace fp8 {
namespace {

// The stream's 32 random bits for element `index` (splitmix64's finaliser,
// twice): a counter-based stream, the same on any number of threads.
uint64_t mix_bits64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
uint64_t stream_key(uint64_t seed) {
  return mix_bits64(seed + 0x9E3779B97F4A7C15ull);
}
uint32_t stream_bits(uint64_t key, uint64_t index) {
  return static_cast<uint32_t>(mix_bits64(key + index) >> 32);
}

// Every code's value, for the decoding loops.
std::array<float, 256> block_decode_table(ElementFormat format) {
  std::array<float, 256> t{};
  const int codes = 1 << limits(format).bits;
  for (int c = 0; c < 256; ++c)
    t[c] = c < codes ? decode_element(static_cast<uint8_t>(c), format) : 0;
  return t;
}

bool has_fp32_scales(const BlockFormat& format) {
  return format.rule() == ScaleRule::kFloat32 || format.rule() == ScaleRule::kFloat32Pow2;
}

// A block's decoding scale and what its elements are multiplied by before
// the cast.
struct BlockScale {
  float decode;  // what the codes are multiplied by
  float encode;  // the elements' factor
};

BlockScale scale_of_block(float amax, const BlockFormat& f, float s_enc, void* stored) {
  const ElementLimits& l = limits(f.element());
  switch (f.rule()) {
    case ScaleRule::kNvfp4: {
      // One rounding of block_amax * (S_enc / 6) to E4M3; no lower clamp.
      const uint8_t byte = encode(amax * (s_enc * (1.0f / 6.0f)), Fp8Format::kE4M3);
      *static_cast<uint8_t*>(stored) = byte;
      const float scale = decode(byte, Fp8Format::kE4M3);
      const float inv = 1.0f / (scale * (1.0f / s_enc));
      return {scale, std::isnan(inv) ? inv : std::min(inv, FLT_MAX)};
    }
    case ScaleRule::kFloat32:
    case ScaleRule::kFloat32Pow2: {
      const float a = std::max(amax, static_cast<float>(f.amax_epsilon()));
      float scale = std::isnan(amax) ? amax : a == 0.0f ? 1.0f : l.max / a;
      if (std::isinf(scale)) scale = FLT_MAX;
      if (f.rule() == ScaleRule::kFloat32Pow2 && std::isfinite(scale) && scale > 0.0f) {
        int e = 0;
        std::frexp(scale, &e);  // scale = m 2^e, m in [0.5, 1): down to 2^(e - 1)
        scale = std::ldexp(1.0f, e - 1);
      }
      const float inv = 1.0f / scale;
      *static_cast<float*>(stored) = inv;
      return {inv, scale};
    }
    default: {
      const uint8_t byte = scale_byte(amax, f.element(), f.rule());
      *static_cast<uint8_t*>(stored) = byte;
      // x / 2^s is the same float32 as x * 2^-s (torchao's RCEIL and TE
      // multiply by the reciprocal, its other rules divide): the reciprocal
      // of a power of two from 2^-127 (a subnormal, never flushed) to 2^127
      // is exact.
      const float scale = scale_value(byte);
      return {scale, 1.0f / scale};
    }
  }
}

void check_block_input(const at::Tensor& x, const BlockFormat& format, const char* what) {
  TORCH_CHECK_VALUE(x.defined() && x.device().is_cpu(), "ampx::fp8::", what,
                    ": x must be a CPU tensor, got ",
                    x.defined() ? x.device().str() : std::string("an undefined tensor"));
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                        x.scalar_type() == at::kHalf,
                    "ampx::fp8::", what, ": x must be float32, bfloat16 or float16, got ",
                    x.scalar_type());
  format.validate();
  TORCH_CHECK_VALUE(x.dim() >= 1, "ampx::fp8::", what, ": x must have a dimension, got a scalar");
  TORCH_CHECK_VALUE(format.block_rows() == 1 || x.dim() == 2, "ampx::fp8::", what, ": blocks of ",
                    format.block_rows(), " x ", format.block_cols(), " take a 2-D tensor, got ",
                    x.sizes());
}

int64_t blocks_over(int64_t n, int64_t block) {
  return (n + block - 1) / block;
}

// How quantize's element loops round: to nearest even, or (stochastic set)
// by the stream of `key`.
struct Rounding {
  const StochasticRounding* stochastic;  // null: nearest even
  uint64_t key;                          // stream_key(stochastic->seed)
};

// out_row[c] for c in [c0, c1): the code of row[c] * factor(c), element
// r * cols + c of the rounding stream (the format dispatched once, outside
// the loop).
template <class Factor>
void encode_span(ElementFormat element, const Rounding& rounding, const float* row,
                 uint8_t* out_row, int64_t r, int64_t cols, int64_t c0, int64_t c1, Factor factor) {
  detail::with_element_code(element, [&](auto encode) {
    if (rounding.stochastic) {
      const uint64_t first = rounding.stochastic->offset + static_cast<uint64_t>(r * cols);
      for (int64_t c = c0; c < c1; ++c) {
        out_row[c] =
            encode(row[c] * factor(c), stream_bits(rounding.key, first + static_cast<uint64_t>(c)));
      }
    } else {
      for (int64_t c = c0; c < c1; ++c) out_row[c] = encode(row[c] * factor(c));
    }
  });
}

// quantize's loops for blocks of br x 1 (br > 1): per block row, the
// columns' amaxes, scales and codes, each loop running along a row.
void quantize_column_blocks(const float* v, int64_t rows, int64_t cols, int64_t br,
                            const BlockFormat& format, float s_enc, const Rounding& rounding,
                            uint8_t* codes, char* scales, size_t scale_bytes) {
  at::parallel_for(0, blocks_over(rows, br), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> amax(static_cast<size_t>(cols)), factor(static_cast<size_t>(cols));
    std::vector<uint8_t> nan(static_cast<size_t>(cols));
    for (int64_t bi = begin; bi < end; ++bi) {
      const int64_t r0 = bi * br, r1 = std::min(rows, r0 + br);
      std::fill(amax.begin(), amax.end(), 0.0f);
      std::fill(nan.begin(), nan.end(), 0);
      for (int64_t r = r0; r < r1; ++r) {
        const float* row = v + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          const float a = std::fabs(row[c]);
          nan[c] |= a != a;
          amax[c] = a > amax[c] ? a : amax[c];
        }
      }
      for (int64_t c = 0; c < cols; ++c) {
        const float m = nan[c] ? std::numeric_limits<float>::quiet_NaN() : amax[c];
        factor[c] = scale_of_block(m, format, s_enc, scales + (bi * cols + c) * scale_bytes).encode;
      }
      const float* f = factor.data();
      for (int64_t r = r0; r < r1; ++r) {
        encode_span(format.element(), rounding, v + r * cols, codes + r * cols, r, cols, 0, cols,
                    [f](int64_t c) { return f[c]; });
      }
    }
  });
}

// quantize's loops for blocks along the rows (br x bc, bc > 1 or br == 1):
// per block, its amax, its scale and its codes.
void quantize_row_blocks(const float* v, int64_t rows, int64_t cols, int64_t br, int64_t bc,
                         const BlockFormat& format, float s_enc, const Rounding& rounding,
                         uint8_t* codes, char* scales, size_t scale_bytes) {
  const int64_t nbc = blocks_over(cols, bc);
  at::parallel_for(0, blocks_over(rows, br), 1, [&](int64_t begin, int64_t end) {
    for (int64_t bi = begin; bi < end; ++bi) {
      const int64_t r0 = bi * br, r1 = std::min(rows, r0 + br);
      for (int64_t bj = 0; bj < nbc; ++bj) {
        const int64_t c0 = bj * bc, c1 = std::min(cols, c0 + bc);
        float amax = 0.0f;
        bool nan = false;
        for (int64_t r = r0; r < r1; ++r) {
          const float* row = v + r * cols;
          for (int64_t c = c0; c < c1; ++c) {
            const float a = std::fabs(row[c]);
            nan |= a != a;
            amax = a > amax ? a : amax;
          }
        }
        if (nan) amax = std::numeric_limits<float>::quiet_NaN();
        const float factor =
            scale_of_block(amax, format, s_enc, scales + (bi * nbc + bj) * scale_bytes).encode;
        for (int64_t r = r0; r < r1; ++r) {
          encode_span(format.element(), rounding, v + r * cols, codes + r * cols, r, cols, c0, c1,
                      [factor](int64_t) { return factor; });
        }
      }
    }
  });
}

// NVFP4's global amax: one parallel reduction, NaN if any element is.
float global_amax_of(const float* v, int64_t n) {
  return at::parallel_reduce(
      0, n, ampx::detail::kElementwiseGrain, 0.0f,
      [&](int64_t begin, int64_t end, float m) {
        bool nan = false;
        for (int64_t i = begin; i < end; ++i) {
          const float a = std::fabs(v[i]);
          nan |= a != a;
          m = a > m ? a : m;
        }
        return nan ? std::numeric_limits<float>::quiet_NaN() : m;
      },
      [](float a, float b) {
        return a != a || b != b ? std::numeric_limits<float>::quiet_NaN() : std::max(a, b);
      });
}

}  // namespace

BlockTensor BlockTensor::quantize(const at::Tensor& x, const BlockFormat& format,
                                  const c10::optional<StochasticRounding>& stochastic) {
  check_block_input(x, format, "BlockTensor::quantize");
  const at::Tensor values = x.to(at::kFloat).contiguous();
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  const int64_t br = format.block_rows(), bc = format.block_cols();
  auto scale_sizes = x.sizes().vec();
  scale_sizes.back() = blocks_over(cols, bc);
  if (br > 1) scale_sizes.front() = blocks_over(rows, br);
  BlockTensor out;
  out.format = format;
  out.codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  out.scales =
      at::empty(scale_sizes, x.options().dtype(has_fp32_scales(format) ? at::kFloat : at::kByte));
  float s_enc = 1.0f;
  const float* v = values.data_ptr<float>();
  if (format.rule() == ScaleRule::kNvfp4) {
    out.global_amax = global_amax_of(v, values.numel());
    s_enc = nvfp4_encode_scale(out.global_amax);
  }
  const Rounding rounding{stochastic ? &*stochastic : nullptr,
                          stochastic ? stream_key(stochastic->seed) : 0};
  uint8_t* codes = out.codes.data_ptr<uint8_t>();
  char* scales = static_cast<char*>(out.scales.data_ptr());
  const size_t scale_bytes = out.scales.element_size();
  if (bc == 1 && br > 1) {
    // Blocks down the columns (a product along the rows: TE's column-wise
    // copy, in place): each pass over a block row is contiguous in memory.
    quantize_column_blocks(v, rows, cols, br, format, s_enc, rounding, codes, scales, scale_bytes);
  } else {
    quantize_row_blocks(v, rows, cols, br, bc, format, s_enc, rounding, codes, scales, scale_bytes);
  }
  return out;
}

at::Tensor BlockTensor::block_values() const {
  const bool fp32_scales = has_fp32_scales(format);
  TORCH_CHECK_VALUE(codes.defined() && scales.defined() && codes.scalar_type() == at::kByte &&
                        codes.device().is_cpu() && codes.dim() >= 1 &&
                        scales.scalar_type() == (fp32_scales ? at::kFloat : at::kByte),
                    "ampx::fp8::BlockTensor: codes must be uint8 CPU tensors and scales ",
                    fp32_scales ? "float32" : "uint8", " for ", format.to_string());
  const int64_t cols = codes.size(-1), rows = cols == 0 ? 0 : codes.numel() / cols;
  const int64_t br = format.block_rows(), bc = format.block_cols();
  const int64_t nbr = blocks_over(rows, br), nbc = blocks_over(cols, bc);
  TORCH_CHECK_VALUE(scales.numel() == nbr * nbc, "ampx::fp8::BlockTensor: ", scales.numel(),
                    " scales for codes ", codes.sizes(), " in blocks of ", br, " x ", bc, " (want ",
                    nbr * nbc, ")");
  const at::Tensor c = codes.contiguous(), s = scales.contiguous();
  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  const std::array<float, 256> table = block_decode_table(format.element());
  const uint8_t* cp = c.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  std::vector<float> block_scale(static_cast<size_t>(nbr * nbc));
  for (int64_t b = 0; b < nbr * nbc; ++b) {
    if (fp32_scales) {
      block_scale[b] = s.data_ptr<float>()[b];
    } else {
      const uint8_t byte = s.data_ptr<uint8_t>()[b];
      block_scale[b] =
          format.rule() == ScaleRule::kNvfp4 ? decode(byte, Fp8Format::kE4M3) : scale_value(byte);
    }
  }
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row_scales = block_scale.data() + (r / br) * nbc;
      const uint8_t* in = cp + r * cols;
      float* o = op + r * cols;
      for (int64_t j = 0; j < nbc; ++j) {
        const float scale = row_scales[j];
        for (int64_t c = j * bc, end_c = std::min(cols, c + bc); c < end_c; ++c) {
          o[c] = table[in[c]] * scale;
        }
      }
    }
  });
  return out;
}

float BlockTensor::tensor_scale() const {
  return format.rule() == ScaleRule::kNvfp4 ? global_amax / (6.0f * 448.0f) : 1.0f;
}

at::Tensor BlockTensor::dequantize(c10::ScalarType out_dtype) const {
  TORCH_CHECK_VALUE(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
                    "ampx::fp8::BlockTensor::dequantize: out_dtype must be float32, bfloat16 or "
                    "float16, got ",
                    out_dtype);
  at::Tensor values = block_values();
  if (format.rule() == ScaleRule::kNvfp4) values.mul_(tensor_scale());
  return values.to(out_dtype);
}

BlockTensor BlockTensor::transposed() const {
  TORCH_CHECK_VALUE(codes.dim() == 2 && format.block_rows() > 1,
                    "ampx::fp8::BlockTensor::transposed: takes a 2-D tensor in 2-D blocks, got ",
                    codes.sizes(), " in blocks of ", format.block_rows(), " x ",
                    format.block_cols());
  BlockTensor t = *this;
  t.codes = codes.t().contiguous();
  t.scales = scales.t().contiguous();
  t.format.block_rows(format.block_cols()).block_cols(format.block_rows());
  return t;
}

}  // namespace fp8
}  // namespace ampx
