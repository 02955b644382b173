#include "ampx/fp8/cast.h"
#include "../core/float_formats.h"
#include "cuda_cast.h"
#include "element_code.h"
#include "fp8_math.h"
#include "../kernels/function_args.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>

namespace ampx {
namespace fp8 {
namespace {

// The constants are the shared table's (src/core/float_formats.h); NaN is 0x7F
// (0xFF with the sign) in both formats, as PyTorch writes it.
constexpr Fp8Limits fp8_limits(const char* name, const ampx::detail::FloatFormatSpec& spec) {
  return Fp8Limits{
      name,     spec.exponent_bits, spec.mantissa_bits,   spec.bias,
      spec.max, spec.min_normal(),  spec.min_subnormal(), static_cast<uint8_t>(spec.max_bits()),
      0x7F};
}

const Fp8Limits kE4M3Limits = fp8_limits("e4m3", ampx::detail::kE4M3);
const Fp8Limits kE5M2Limits = fp8_limits("e5m2", ampx::detail::kE5M2);

// The code of float32 `value`: fp8_math.h's encode, which the CUDA cast runs too.
uint8_t encode_value(float value, Fp8Format format) {
  return format == Fp8Format::kE4M3 ? math::encode<math::Format::kE4M3>(value)
                                    : math::encode<math::Format::kE5M2>(value);
}

std::array<float, 256> make_decode_table(const Fp8Limits& f) {
  std::array<float, 256> table{};
  for (int c = 0; c < 256; ++c) {
    const int exp_field = (c & 0x7F) >> f.mantissa_bits;
    const int mant = c & ((1 << f.mantissa_bits) - 1);
    const int exp_all_ones = (1 << f.exponent_bits) - 1;
    float v;
    if (f.exponent_bits == 4 && exp_field == exp_all_ones && mant == 7) {
      v = std::numeric_limits<float>::quiet_NaN();  // e4m3fn: the only NaN
    } else if (f.exponent_bits == 5 && exp_field == exp_all_ones) {
      v = mant == 0 ? std::numeric_limits<float>::infinity()
                    : std::numeric_limits<float>::quiet_NaN();
    } else {
      v = detail::magnitude_value(static_cast<uint32_t>(c & 0x7F), f.bias, f.mantissa_bits);
    }
    table[c] = (c & 0x80) ? -v : v;
  }
  return table;
}

const std::array<float, 256>& decode_table(Fp8Format format) {
  static const std::array<float, 256> e4m3 = make_decode_table(kE4M3Limits);
  static const std::array<float, 256> e5m2 = make_decode_table(kE5M2Limits);
  return format == Fp8Format::kE4M3 ? e4m3 : e5m2;
}

void check_float_input(const at::Tensor& x, const char* fn) {
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, "ampx::fp8::", fn,
              ": x must be float32, bfloat16 or float16, got ", t);
}

void check_scale(const at::Tensor& t, const char* fn, const char* what) {
  TORCH_CHECK(t.numel() == 1 && t.scalar_type() == at::kFloat, "ampx::fp8::", fn, ": ", what,
              " must be a float32 tensor of one element, got ", t.scalar_type(), " with ",
              t.numel(), " elements");
}

// The elements [begin, end) of float32 `in` times scale, as codes.
template <math::Format kFormat>
void encode_span(const float* in, uint8_t* out, int64_t begin, int64_t end, float scale) {
  for (int64_t i = begin; i < end; ++i) out[i] = math::encode<kFormat>(in[i] * scale);
}

// The CPU kernel: codes of float32 x * scale (the loop has no branches: it
// vectorises).
at::Tensor quantize_cpu(const at::Tensor& x, Fp8Format format, float scale) {
  const at::Tensor x32 = x.to(at::kFloat).contiguous();  // exact for bf16/fp16
  at::Tensor codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  const float* in = x32.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  at::parallel_for(0, x32.numel(), ampx::detail::kElementwiseGrain,
                   [&](int64_t begin, int64_t end) {
                     if (format == Fp8Format::kE4M3) {
                       encode_span<math::Format::kE4M3>(in, out, begin, end, scale);
                     } else {
                       encode_span<math::Format::kE5M2>(in, out, begin, end, scale);
                     }
                   });
  return codes;
}

at::Tensor dequantize_cpu(const at::Tensor& codes, Fp8Format format, float scale_inv) {
  const at::Tensor c = codes.contiguous();
  at::Tensor values = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  const auto& table = decode_table(format);
  const uint8_t* in = c.data_ptr<uint8_t>();
  float* out = values.data_ptr<float>();
  at::parallel_for(0, c.numel(), ampx::detail::kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = table[in[i]] * scale_inv;
  });
  return values;
}

}  // namespace

const Fp8Limits& limits(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? kE4M3Limits : kE5M2Limits;
}

std::string to_string(Fp8Format format) {
  return limits(format).name;
}

float decode(uint8_t code, Fp8Format format) {
  return decode_table(format)[code];
}

uint8_t encode(float value, Fp8Format format) {
  return encode_value(value, format);
}

at::Tensor quantize(const at::Tensor& x, Fp8Format format, const at::Tensor& scale) {
  check_float_input(x, "quantize");
  check_scale(scale, "quantize", "scale");
  if (x.is_cuda() && detail::cuda::built()) {
    return detail::cuda::cast(x, format, scale.reshape({1}).to(at::kFloat).to(x.device()).contiguous(),
                              /*transpose=*/false, at::Tensor())
        .codes;  // one pass on the device, no host sync
  }
  if (!x.is_cpu()) {  // another device: through the host (slow, synchronizing)
    return quantize_cpu(x.cpu(), format, scale.item<float>()).to(x.device());
  }
  return quantize_cpu(x, format, scale.item<float>());
}

at::Tensor dequantize(const at::Tensor& codes, Fp8Format format, const at::Tensor& scale_inv,
                      c10::ScalarType out_dtype) {
  return Fp8Tensor{codes, scale_inv, format}.dequantize(out_dtype);
}

Fp8Tensor Fp8Tensor::quantize(const at::Tensor& x, Fp8Format format, const at::Tensor& scale) {
  at::Tensor codes = fp8::quantize(x, format, scale);  // checks scale: float32, one element
  return {std::move(codes), at::ones_like(scale).div(scale), format};
}

at::Tensor Fp8Tensor::dequantize(c10::ScalarType out_dtype) const {
  TORCH_CHECK(codes.scalar_type() == at::kByte, "ampx::fp8::dequantize: codes must be uint8, got ",
              codes.scalar_type());
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              "ampx::fp8::dequantize: out_dtype must be float32, bfloat16 or float16, got ",
              out_dtype);
  check_scale(scale_inv, "dequantize", "scale_inv");
  if (!codes.is_cpu()) {
    // The 256 values as a table on the device: one gather, no host round trip.
    const auto& table = decode_table(format);
    const at::Tensor lut =
        at::from_blob(const_cast<float*>(table.data()), {256}, at::kFloat).to(codes.device());
    return lut.index_select(0, codes.reshape(-1).to(at::kLong))
        .reshape(codes.sizes())
        .mul(scale_inv.to(codes.device()))
        .to(out_dtype);
  }
  return dequantize_cpu(codes, format, scale_inv.item<float>()).to(out_dtype);
}

at::Tensor round_to_fp8(const at::Tensor& x, Fp8Format format) {
  check_float_input(x, "round_to_fp8");
  const at::Tensor one = at::ones({}, x.options().dtype(at::kFloat));
  return dequantize(quantize(x, format, one), format, one, x.scalar_type());
}

#if AMPX_HAS_TORCH_FLOAT8
c10::ScalarType torch_dtype(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

at::Tensor codes_to_torch_float8(const at::Tensor& codes, Fp8Format format) {
  TORCH_CHECK(codes.scalar_type() == at::kByte,
              "ampx::fp8::codes_to_torch_float8: codes must be uint8, got ", codes.scalar_type());
  return codes.view(torch_dtype(format));
}

at::Tensor torch_float8_to_codes(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat8_e4m3fn || x.scalar_type() == at::kFloat8_e5m2,
              "ampx::fp8::torch_float8_to_codes: x must be float8_e4m3fn or float8_e5m2, got ",
              x.scalar_type());
  return x.view(at::kByte);
}
#endif

}  // namespace fp8
}  // namespace ampx
