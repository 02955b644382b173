// MixedPrecisionOptimizer's state formats (MixedPrecisionConfig::state_format,
// kahan_summation): which params keep coded moments or a Kahan compensation,
// their zero state, their moments decoded for exp_avg() / exp_avg_sq(), the
// bytes the optimizer holds. The step itself: optimizer.cpp and fused/.

#include "ampx/optim/optimizer.h"

#include "fused/cuda_step.h"

#include "fused/state_codes.h"
#include "fused/state_tiles.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

namespace ampx {
namespace optim {

const char* state_format_name(StateFormat format) {
  switch (format) {
    case StateFormat::kFp32:
      return "fp32";
    case StateFormat::kBf16:
      return "bf16";
    case StateFormat::kFp8:
      return "fp8";
    case StateFormat::kInt8:
      return "8bit";
  }
  return "?";
}

StateFormat state_format_from_name(const std::string& name) {
  for (auto f : {StateFormat::kFp32, StateFormat::kBf16, StateFormat::kFp8, StateFormat::kInt8}) {
    if (name == state_format_name(f)) return f;
  }
  TORCH_CHECK(false, "ampx::optim: unknown state format '", name,
              "'; expected fp32, bf16, fp8 or 8bit");
}

bool MixedPrecisionOptimizer::coded_moments(const at::Tensor& param) const {
  return config_.state_format != StateFormat::kFp32 && param.numel() >= config_.state_min_numel;
}

bool MixedPrecisionOptimizer::kahan(const at::Tensor& param) const {
  return config_.kahan_summation && param.scalar_type() != at::kFloat;
}

void MixedPrecisionOptimizer::check_untiled(const detail::ParamWork& w, bool cuda_tiles) const {
  if (!(coded_moments(w.param) || kahan(w.param))) return;
  // The fused CUDA step runs the tiles too (cuda_step.cu).
  const bool dense = w.param.is_contiguous() && w.grad.is_contiguous();
  const bool on_cuda = cuda_tiles && detail::cuda::built() && w.param.is_cuda() && dense;
  TORCH_CHECK(on_cuda, "ampx::optim::", name(), ": ",
              coded_moments(w.param)
                  ? std::string("state_format ") + state_format_name(config_.state_format)
                  : std::string("kahan_summation"),
              " is implemented for dense CPU and CUDA params and grads; param (group ", w.group,
              ", index ", w.index, ") is ",
              dense ? "on " + w.param.device().str() : "not contiguous");
}

void MixedPrecisionOptimizer::make_moment(const at::Tensor& param, bool is_signed,
                                          at::Tensor& moment, at::Tensor& scale) const {
  const auto opts = param.options();
  if (!coded_moments(param)) {
    moment = at::zeros(param.sizes(), opts.dtype(at::kFloat));
    return;
  }
  switch (config_.state_format) {
    case StateFormat::kBf16:
      moment = at::zeros(param.sizes(), opts.dtype(at::kBFloat16));
      return;
    case StateFormat::kFp8:
      moment = at::zeros(param.sizes(), opts.dtype(at::kByte));  // E4M3 0x00: zero
      break;
    case StateFormat::kInt8:
      moment = at::full(param.sizes(),
                        is_signed ? ::ampx::detail::math::kSignedZeroCode
                                  : ::ampx::detail::math::kUnsignedZeroCode,
                        opts.dtype(at::kByte));
      break;
    case StateFormat::kFp32:
      break;
  }
  const int64_t blocks = (param.numel() + config_.state_block - 1) / config_.state_block;
  scale = at::zeros({blocks}, opts.dtype(at::kFloat));
}

namespace {

// A moment in fp32: itself, or its codes decoded a block at a time.
at::Tensor decoded(const at::Tensor& moment, const at::Tensor& scale, int moment_index,
                   const MixedPrecisionConfig& config) {
  if (!moment.defined() || moment.scalar_type() == at::kFloat) return moment;
  if (moment.scalar_type() == at::kBFloat16) return moment.to(at::kFloat);
  auto codes = moment.cpu().contiguous();
  auto scales = scale.cpu().contiguous();
  auto out = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  detail::FusedParam p;
  p.state_format = static_cast<detail::FusedState>(config.state_format);
  p.state_block = static_cast<int32_t>(config.state_block);
  (moment_index == 0 ? p.exp_avg_codes : p.exp_avg_sq_codes) = codes.data_ptr();
  (moment_index == 0 ? p.exp_avg_scale : p.exp_avg_sq_scale) = scales.data_ptr<float>();
  const int64_t n = codes.numel(), block = config.state_block;
  for (int64_t b = 0; b < n; b += block) {
    detail::decode_moment(p, moment_index, b, std::min(block, n - b), out.data_ptr<float>() + b);
  }
  return out.to(moment.device());
}

}  // namespace

CodedMoment coded_moment(const MixedPrecisionConfig& config, const at::Tensor& values,
                         bool first_moment, uint64_t key) {
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.is_cpu(),
              "ampx::optim::coded_moment: values must be a float32 CPU tensor, got ",
              values.scalar_type(), " on ", values.device());
  const auto in = values.contiguous();
  if (config.state_format == StateFormat::kFp32 || in.numel() < config.state_min_numel) {
    return {in.clone(), at::Tensor()};
  }
  const int moment = first_moment ? 0 : 1;
  const int64_t n = in.numel(), block = config.state_block;
  CodedMoment out;
  detail::FusedParam p;
  p.state_format = static_cast<detail::FusedState>(config.state_format);
  p.state_block = static_cast<int32_t>(block);
  if (config.state_format == StateFormat::kBf16) {
    out.values = at::empty(in.sizes(), in.options().dtype(at::kBFloat16));
    (moment == 0 ? p.exp_avg_codes : p.exp_avg_sq_codes) = out.values.data_ptr();
    detail::encode_moment(p, key, moment, 0, n, in.data_ptr<float>());
    return out;
  }
  out.values = at::empty(in.sizes(), in.options().dtype(at::kByte));
  out.scale = at::empty({(n + block - 1) / block}, in.options());
  (moment == 0 ? p.exp_avg_codes : p.exp_avg_sq_codes) = out.values.data_ptr();
  (moment == 0 ? p.exp_avg_scale : p.exp_avg_sq_scale) = out.scale.data_ptr<float>();
  for (int64_t b = 0; b < n; b += block) {
    detail::encode_moment(p, key, moment, b, std::min(block, n - b), in.data_ptr<float>() + b);
  }
  return out;
}

at::Tensor MixedPrecisionOptimizer::exp_avg(const at::Tensor& param) const {
  const auto* st = find_state(param);
  return st ? decoded(st->exp_avg, st->exp_avg_scale, 0, config_) : at::Tensor();
}

at::Tensor MixedPrecisionOptimizer::exp_avg_sq(const at::Tensor& param) const {
  const auto* st = find_state(param);
  return st ? decoded(st->exp_avg_sq, st->exp_avg_sq_scale, 1, config_) : at::Tensor();
}

at::Tensor MixedPrecisionOptimizer::compensation(const at::Tensor& param) const {
  const auto* st = find_state(param);
  return st ? st->compensation : at::Tensor();
}

int64_t MixedPrecisionOptimizer::state_bytes() const {
  int64_t total = 0;
  for (const auto& group : states_) {
    for (const auto& st : group) {
      for (const auto* t : {&st.master, &st.captured, &st.exp_avg, &st.exp_avg_sq,
                            &st.exp_avg_scale, &st.exp_avg_sq_scale, &st.compensation}) {
        if (t->defined()) total += t->numel() * static_cast<int64_t>(t->element_size());
      }
    }
  }
  return total;
}

}  // namespace optim
}  // namespace ampx
