// BlockTensor's loops (ampx/fp8/block.h) on the CPU: quantize (each block's
// amax, its scale by the format's rule, its elements' codes) and the way
// back (block_values, dequantize), and the transpose of 2-D blocks; CUDA
// tensors go to cuda/block_kernels.cu (block_cuda.h), which runs the same
// per-block and per-element arithmetic (block_math.h).

#include "ampx/fp8/block.h"

#include "../../kernels/function_args.h"
#include "block_cuda.h"
#include "block_element_code.h"
#include "block_math.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace ampx {
namespace fp8 {
namespace {

// Every code's value, for the decoding loops (the CPU's and the kernel's).
detail::cuda_block::DecodeTable block_decode_table(ElementFormat format) {
  detail::cuda_block::DecodeTable t{};
  const int codes = 1 << limits(format).bits;
  for (int c = 0; c < 256; ++c)
    t.value[c] = c < codes ? decode_element(static_cast<uint8_t>(c), format) : 0;
  return t;
}

bool has_fp32_scales(const BlockFormat& format) {
  return format.rule() == ScaleRule::kFloat32 || format.rule() == ScaleRule::kFloat32Pow2;
}

// A block's scale (block_math.h) written where the block's scale is stored
// (a byte, or a float32); what its elements are multiplied by.
float store_scale(float amax, const block_math::ScaleParams& p, float s_enc, char* stored,
                  size_t scale_bytes) {
  const block_math::BlockScale s = block_math::block_scale(amax, p, s_enc);
  if (scale_bytes == sizeof(float)) {
    std::memcpy(stored, &s.stored_float, sizeof(float));
  } else {
    *reinterpret_cast<uint8_t*>(stored) = s.byte;
  }
  return s.encode;
}

void check_block_input(const at::Tensor& x, const BlockFormat& format, const char* what) {
  TORCH_CHECK_VALUE(x.defined() && (x.device().is_cpu() || x.is_cuda()), "ampx::fp8::", what,
                    ": x must be a CPU or CUDA tensor, got ",
                    x.defined() ? x.device().str() : std::string("an undefined tensor"));
  TORCH_CHECK_VALUE(!x.is_cuda() || detail::cuda_block::built(), "ampx::fp8::", what,
                    ": this build of ampx has no CUDA kernels (x is on ", x.device(), ")");
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
  uint64_t key;                          // block_math::stream_key(stochastic->seed)
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
        const uint32_t random =
            block_math::stream_bits(rounding.key, first + static_cast<uint64_t>(c));
        out_row[c] = encode.scaled(row[c], factor(c), random);
      }
    } else {
      for (int64_t c = c0; c < c1; ++c) out_row[c] = encode.scaled(row[c], factor(c));
    }
  });
}

// quantize's loops for blocks of br x 1 (br > 1): per block row, the
// columns' amaxes, scales and codes, each loop running along a row.
void quantize_column_blocks(const float* v, int64_t rows, int64_t cols, int64_t br,
                            const BlockFormat& format, float s_enc, const Rounding& rounding,
                            uint8_t* codes, char* scales, size_t scale_bytes) {
  const block_math::ScaleParams params = block_math::scale_params(format);
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
        factor[c] = store_scale(block_math::block_amax(amax[c], nan[c]), params, s_enc,
                                scales + (bi * cols + c) * scale_bytes, scale_bytes);
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
  const block_math::ScaleParams params = block_math::scale_params(format);
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
        const float factor = store_scale(block_math::block_amax(amax, nan), params, s_enc,
                                         scales + (bi * nbc + bj) * scale_bytes, scale_bytes);
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
        return block_math::block_amax(m, nan);
      },
      [](float a, float b) { return a != a || b != b ? block_math::quiet_nan() : std::max(a, b); });
}

}  // namespace

BlockTensor BlockTensor::quantize(const at::Tensor& x, const BlockFormat& format,
                                  const c10::optional<StochasticRounding>& stochastic,
                                  const c10::optional<float>& global_amax) {
  check_block_input(x, format, "BlockTensor::quantize");
  TORCH_CHECK_VALUE(!global_amax || format.rule() == ScaleRule::kNvfp4,
                    "ampx::fp8::BlockTensor::quantize: global_amax is NVFP4's alone, got it for ",
                    format.to_string());
  if (x.is_cuda()) return detail::cuda_block::quantize(x, format, stochastic, global_amax);
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
    out.global_amax = global_amax ? *global_amax : global_amax_of(v, values.numel());
    s_enc = block_math::nvfp4_encode_scale(out.global_amax);
  }
  const Rounding rounding{stochastic ? &*stochastic : nullptr,
                          stochastic ? block_math::stream_key(stochastic->seed) : 0};
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
                        (codes.device().is_cpu() || codes.is_cuda()) &&
                        scales.device() == codes.device() && codes.dim() >= 1 &&
                        scales.scalar_type() == (fp32_scales ? at::kFloat : at::kByte),
                    "ampx::fp8::BlockTensor: codes must be uint8 CPU or CUDA tensors and scales ",
                    fp32_scales ? "float32" : "uint8", " on their device, for ",
                    format.to_string());
  TORCH_CHECK_VALUE(!codes.is_cuda() || detail::cuda_block::built(),
                    "ampx::fp8::BlockTensor: this build of ampx has no CUDA kernels (codes on ",
                    codes.device(), ")");
  const int64_t cols = codes.size(-1), rows = cols == 0 ? 0 : codes.numel() / cols;
  const int64_t br = format.block_rows(), bc = format.block_cols();
  const int64_t nbr = blocks_over(rows, br), nbc = blocks_over(cols, bc);
  TORCH_CHECK_VALUE(scales.numel() == nbr * nbc, "ampx::fp8::BlockTensor: ", scales.numel(),
                    " scales for codes ", codes.sizes(), " in blocks of ", br, " x ", bc, " (want ",
                    nbr * nbc, ")");
  const detail::cuda_block::DecodeTable table = block_decode_table(format.element());
  if (codes.is_cuda()) return detail::cuda_block::block_values(*this, table);
  const at::Tensor c = codes.contiguous(), s = scales.contiguous();
  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  const uint8_t* cp = c.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  std::vector<float> block_scale(static_cast<size_t>(nbr * nbc));
  for (int64_t b = 0; b < nbr * nbc; ++b) {
    if (fp32_scales) {
      block_scale[b] = s.data_ptr<float>()[b];
    } else {
      block_scale[b] = block_math::scale_of_byte(s.data_ptr<uint8_t>()[b], format.rule());
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
          o[c] = table.value[in[c]] * scale;
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
