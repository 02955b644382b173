// The FP8 recipes (delayed, current, and the block recipes' holder Recipe)
// and DelayedScalingState, TE's amax history and scale update. The per-role
// scaling that uses them: tensor_scaling.cpp.

#include "ampx/fp8/scaling.h"
#include "ampx/fp8/linear.h"
#include "autocast_internal.h"
#include "block/block_internal.h"
#include "cuda_cast.h"
#include "fp8_math.h"
#include "scaling_internal.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <sstream>

namespace ampx {
namespace fp8 {
namespace {

constexpr int64_t kStateVersion = 1;

const char* to_string(AmaxComputeAlgo a) {
  return a == AmaxComputeAlgo::kMax ? "max" : "most_recent";
}

void check_not_e5m2(RecipeFormat f, const char* recipe) {
  // TE: `assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."`
  TORCH_CHECK(f != RecipeFormat::kE5M2, recipe,
              ": pure E5M2 training is not supported (fp8_format must be E4M3 or HYBRID)");
}

// A float32 [1] tensor holding `value`, like `like`.
at::Tensor full1(const at::Tensor& like, float value) {
  return at::full({1}, value, like.options().dtype(at::kFloat));
}

// One amax as float32 [1] on `device` (no host sync: checks are on metadata).
at::Tensor one_amax(const at::Tensor& amax, c10::Device device, const char* fn) {
  TORCH_CHECK(amax.numel() == 1, fn, ": amax must have one element, got ", amax.numel());
  TORCH_CHECK(amax.device() == device, fn, ": amax is on ", amax.device(), " but the state is on ",
              device);
  return amax.reshape({1}).to(at::kFloat);
}

template <class T>
T read_value(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue v;
  TORCH_CHECK(archive.try_read(key, v), "DelayedScalingState.load: '", key, "' is missing");
  return v.to<T>();
}

}  // namespace

Fp8Format format_for(RecipeFormat recipe_format, Direction pass) {
  switch (recipe_format) {
    case RecipeFormat::kE4M3:
      return Fp8Format::kE4M3;
    case RecipeFormat::kE5M2:
      return Fp8Format::kE5M2;
    case RecipeFormat::kHybrid:
      return pass == Direction::kForward ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
  }
  return Fp8Format::kE4M3;
}

at::Tensor compute_amax(const at::Tensor& x) {
  if (x.numel() == 0) return at::zeros({1}, x.options().dtype(at::kFloat));
  if (detail::cuda::takes(x)) return detail::cuda::amax(x);  // one reduction kernel
  return x.abs().max().reshape({1}).to(at::kFloat);
}

void DelayedScaling::validate() const {
  check_not_e5m2(fp8_format_, "DelayedScaling");
  TORCH_CHECK(amax_history_len_ >= 1, "DelayedScaling: amax_history_len must be >= 1, got ",
              amax_history_len_);
  TORCH_CHECK(margin_ >= 0, "DelayedScaling: margin must be >= 0, got ", margin_);
}

DelayedScalingState::DelayedScalingState(const DelayedScaling& recipe, Direction pass,
                                         c10::Device device)
    : recipe_(recipe), format_(format_for(recipe.fp8_format(), pass)) {
  recipe_.validate();
  // As TE: fp8_max * 2^-margin in float32.
  scaled_max_ = limits(format_).max * std::pow(2.0f, -static_cast<float>(recipe_.margin()));
  const auto options = at::TensorOptions().dtype(at::kFloat).device(device);
  amax_history_ = at::zeros({recipe_.amax_history_len()}, options);
  scale_ = at::ones({1}, options);
  scale_inv_ = at::ones({1}, options);
}

namespace detail {

cuda::DelayedArgs delayed_args(const DelayedScalingState& state, const at::Tensor& amax) {
  cuda::DelayedArgs a;
  a.history = state.amax_history().data_ptr<float>();
  a.amax = amax.data_ptr<float>();
  a.scale = state.scale().data_ptr<float>();
  a.scale_inv = state.scale_inv().data_ptr<float>();
  a.len = state.amax_history().numel();
  a.scaled_max = state.scaled_max();
  a.most_recent = state.recipe().amax_compute_algo() == AmaxComputeAlgo::kMostRecent ? 1 : 0;
  return a;
}

}  // namespace detail

namespace {

// TE's amax_and_scale_update on one state's float32 values (host memory),
// with fp8_math.h's functions, which the CUDA kernel runs per state too.
void delayed_update_values(float* history, int64_t len, float amax, float scaled_max,
                           bool most_recent, float* scale, float* scale_inv) {
  if (math::delayed_seen(amax)) {
    float window = math::window_max(0.0f, amax);
    for (int64_t i = 1; i < len; ++i) window = math::window_max(window, history[i]);
    *scale = math::delayed_scale(most_recent ? amax : window, scaled_max, *scale);
    for (int64_t i = 0; i < len; ++i) history[i] = math::rolled_entry(history, len, i, amax);
  }
  *scale_inv = 1.0f / *scale;
}

}  // namespace

void DelayedScalingState::update(const at::Tensor& amax) {
  const at::Tensor last = one_amax(amax, amax_history_.device(), "DelayedScalingState.update");
  const bool most_recent = recipe_.amax_compute_algo() == AmaxComputeAlgo::kMostRecent;
  if (amax_history_.is_cuda() && detail::cuda::built()) {
    // One launch, no host sync (several states at once: detail::record_all).
    detail::cuda::delayed_update({detail::delayed_args(*this, last)}, amax_history_.device());
    return;
  }
  // The CPU (any other device: through host copies).
  at::Tensor history = amax_history_.cpu().contiguous(), scale = scale_.cpu(), scale_inv = scale_inv_.cpu();
  delayed_update_values(history.data_ptr<float>(), history.numel(), last.cpu().item<float>(),
                        scaled_max_, most_recent, scale.data_ptr<float>(), scale_inv.data_ptr<float>());
  if (!amax_history_.is_cpu()) {
    amax_history_.copy_(history);
    scale_.copy_(scale);
    scale_inv_.copy_(scale_inv);
  }
}

void DelayedScalingState::save(torch::serialize::OutputArchive& archive,
                               const std::string& prefix) const {
  archive.write(prefix + ".version", c10::IValue(kStateVersion));
  archive.write(prefix + ".fp8_format", c10::IValue(std::string(to_string(format_))));
  archive.write(prefix + ".margin", c10::IValue(recipe_.margin()));
  archive.write(prefix + ".amax_compute_algo",
                c10::IValue(std::string(to_string(recipe_.amax_compute_algo()))));
  archive.write(prefix + ".amax_history", amax_history_.cpu(), /*is_buffer=*/true);
  archive.write(prefix + ".scale", scale_.cpu(), /*is_buffer=*/true);
  archive.write(prefix + ".scale_inv", scale_inv_.cpu(), /*is_buffer=*/true);
}

void DelayedScalingState::load(torch::serialize::InputArchive& archive, const std::string& prefix) {
  const auto version = read_value<int64_t>(archive, prefix + ".version");
  TORCH_CHECK(version >= 1 && version <= kStateVersion, "DelayedScalingState.load: '", prefix,
              ".version' is ", version, " but this ampx reads versions 1 to ", kStateVersion);
  const auto format = read_value<std::string>(archive, prefix + ".fp8_format");
  TORCH_CHECK(format == to_string(format_), "DelayedScalingState.load: the saved state is ", format,
              " but this state is ", to_string(format_));
  const auto margin = read_value<int64_t>(archive, prefix + ".margin");
  TORCH_CHECK(margin == recipe_.margin(), "DelayedScalingState.load: the saved margin is ", margin,
              " but this recipe's is ", recipe_.margin());
  const auto algo = read_value<std::string>(archive, prefix + ".amax_compute_algo");
  TORCH_CHECK(algo == to_string(recipe_.amax_compute_algo()),
              "DelayedScalingState.load: the saved amax_compute_algo is ", algo,
              " but this recipe's is ", to_string(recipe_.amax_compute_algo()));
  at::Tensor history, scale, scale_inv;
  archive.read(prefix + ".amax_history", history, /*is_buffer=*/true);
  archive.read(prefix + ".scale", scale, /*is_buffer=*/true);
  archive.read(prefix + ".scale_inv", scale_inv, /*is_buffer=*/true);
  TORCH_CHECK(history.dim() == 1 && history.size(0) == amax_history_.size(0),
              "DelayedScalingState.load: the saved amax history has ", history.numel(),
              " entries but this recipe's amax_history_len is ", amax_history_.size(0));
  TORCH_CHECK(scale.numel() == 1 && scale_inv.numel() == 1 && history.scalar_type() == at::kFloat &&
                  scale.scalar_type() == at::kFloat && scale_inv.scalar_type() == at::kFloat,
              "DelayedScalingState.load: scale and scale_inv must be float32 of one element");
  amax_history_.copy_(history);
  scale_.copy_(scale.reshape({1}));
  scale_inv_.copy_(scale_inv.reshape({1}));
}

void CurrentScaling::validate() const {
  check_not_e5m2(fp8_format_, "CurrentScaling");
  TORCH_CHECK(amax_epsilon_ >= 0, "CurrentScaling: amax_epsilon must be >= 0, got ", amax_epsilon_);
}

at::Tensor current_scale(const at::Tensor& amax, Fp8Format format, const CurrentScaling& recipe) {
  TORCH_CHECK(amax.numel() == 1, "ampx::fp8::current_scale: amax must have one element, got ",
              amax.numel());
  const at::Tensor a32 = amax.reshape({1}).to(at::kFloat).contiguous();
  const float fp8_max = limits(format).max;
  const auto epsilon = static_cast<float>(recipe.amax_epsilon());
  if (a32.is_cuda() && detail::cuda::built()) {
    at::Tensor scale = at::empty({1}, a32.options()), scale_inv = at::empty({1}, a32.options());
    detail::cuda::current_scale(a32, fp8_max, epsilon, recipe.power_2_scale(), scale, scale_inv);
    return scale.reshape(amax.sizes());
  }
  // The CPU (any other device: through a host copy).
  const float scale = math::current_scale(a32.cpu().item<float>(), fp8_max, epsilon,
                                          recipe.power_2_scale());
  return full1(a32, scale).reshape(amax.sizes());
}

CurrentScaled quantize_current(const at::Tensor& x, const CurrentScaling& recipe, Direction pass) {
  recipe.validate();
  const Fp8Format format = format_for(recipe.fp8_format(), pass);
  const at::Tensor scale = current_scale(compute_amax(x), format, recipe);
  const at::Tensor scale_inv = full1(scale, 1.0f).div(scale);
  return {{quantize(x, format, scale), scale_inv, format}, scale};
}

Recipe::Recipe(const DelayedScaling& delayed)
    : kind_(Kind::kDelayed), delayed_options_(delayed) {}
Recipe::Recipe(const CurrentScaling& current) : kind_(Kind::kCurrent), current_options_(current) {}
Recipe::Recipe(const MXFP8BlockScaling& mxfp8) : kind_(Kind::kMxfp8), mxfp8_options_(mxfp8) {}
Recipe::Recipe(const NVFP4BlockScaling& nvfp4) : kind_(Kind::kNvfp4), nvfp4_options_(nvfp4) {}
Recipe::Recipe(const Float8BlockScaling& block)
    : kind_(Kind::kFloat8Block), float8_block_options_(block) {}

const DelayedScaling& Recipe::delayed() const {
  TORCH_CHECK(kind_ == Kind::kDelayed, "ampx::fp8::Recipe: ", to_string(),
              " is not a delayed-scaling recipe");
  return delayed_options_;
}

const CurrentScaling& Recipe::current() const {
  TORCH_CHECK(kind_ == Kind::kCurrent, "ampx::fp8::Recipe: ", to_string(),
              " is not a current-scaling recipe");
  return current_options_;
}

const MXFP8BlockScaling& Recipe::mxfp8() const {
  TORCH_CHECK(kind_ == Kind::kMxfp8, "ampx::fp8::Recipe: ", to_string(), " is not MXFP8");
  return mxfp8_options_;
}

const NVFP4BlockScaling& Recipe::nvfp4() const {
  TORCH_CHECK(kind_ == Kind::kNvfp4, "ampx::fp8::Recipe: ", to_string(), " is not NVFP4");
  return nvfp4_options_;
}

const Float8BlockScaling& Recipe::float8_block() const {
  TORCH_CHECK(kind_ == Kind::kFloat8Block, "ampx::fp8::Recipe: ", to_string(),
              " is not FP8 block scaling");
  return float8_block_options_;
}

RecipeFormat Recipe::fp8_format() const {
  switch (kind_) {
    case Kind::kDelayed: return delayed_options_.fp8_format();
    case Kind::kCurrent: return current_options_.fp8_format();
    case Kind::kMxfp8: return mxfp8_options_.fp8_format();
    case Kind::kFloat8Block: return RecipeFormat::kE4M3;
    case Kind::kNvfp4: break;
  }
  TORCH_CHECK(false, "ampx::fp8::Recipe: ", to_string(), " has no FP8 format (E2M1 elements)");
}

void Recipe::validate() const {
  switch (kind_) {
    case Kind::kDelayed: delayed_options_.validate(); break;
    case Kind::kCurrent: current_options_.validate(); break;
    case Kind::kMxfp8: mxfp8_options_.validate(); break;
    case Kind::kNvfp4: nvfp4_options_.validate(); break;
    case Kind::kFloat8Block: float8_block_options_.validate(); break;
  }
}

std::string Recipe::to_string() const {
  switch (kind_) {
    case Kind::kMxfp8: return mxfp8_options_.to_string();
    case Kind::kNvfp4: return nvfp4_options_.to_string();
    case Kind::kFloat8Block: return float8_block_options_.to_string();
    case Kind::kDelayed:
    case Kind::kCurrent: break;
  }
  const char* format = detail::recipe_format_name(fp8_format());
  std::ostringstream s;
  if (kind_ == Kind::kDelayed) {
    s << "delayed(" << format << ", history " << delayed_options_.amax_history_len() << ", "
      << (delayed_options_.amax_compute_algo() == AmaxComputeAlgo::kMax ? "max" : "most_recent")
      << ", margin " << delayed_options_.margin() << ")";
  } else {
    s << "current(" << format << (current_options_.power_2_scale() ? ", power-of-2 scales" : "");
    if (current_options_.amax_epsilon() > 0)
      s << ", amax_epsilon " << current_options_.amax_epsilon();
    s << ")";
  }
  return s.str();
}

}  // namespace fp8
}  // namespace ampx
