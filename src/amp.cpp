// initialize() and the opt levels O0-O3.

#include "ampx/amp.h"

#include "ampx/autocast.h"
#include "ampx/fp8/linear.h"
#include "ampx/kernels/cpu_products.h"
#include "ampx/optim/optimizer.h"
#include "ampx/policy.h"
#include "norm_layers.h"
#include "policy/registry.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/nn.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <sstream>

namespace ampx {

OptLevel parse_opt_level(const std::string& name) {
  if (name == "O0") return OptLevel::O0;
  if (name == "O1") return OptLevel::O1;
  if (name == "O2") return OptLevel::O2;
  if (name == "O3") return OptLevel::O3;
  TORCH_CHECK_VALUE(false, "parse_opt_level: unknown opt level '", name,
                    "'; expected O0, O1, O2 or O3 (capital letter O, as in Apex)");
}

std::string to_string(OptLevel level) {
  return "O" + std::to_string(static_cast<int>(level));
}

LossScale LossScale::fixed(double value) {
  TORCH_CHECK_VALUE(std::isfinite(value) && value > 0.0,
                    "LossScale::fixed: the scale must be finite and > 0, got ", value);
  return LossScale(false, value);
}

std::string AmpProperties::to_string() const {
  std::ostringstream out;
  auto row = [&](const char* key, const std::string& value) {
    out << "  " << key << std::string(24 - std::string(key).size(), ' ') << value << "\n";
  };
  auto yes = [](bool b) { return std::string(b ? "true" : "false"); };
  row("opt_level", ampx::to_string(opt_level));
  row("device", device.str());
  row("dtype", c10::toString(dtype));
  row("cast_model_type", cast_model_type ? c10::toString(dtype) : std::string("none"));
  row("patch_torch_functions", yes(patch_torch_functions));
  row("keep_batchnorm_fp32", yes(keep_batchnorm_fp32));
  row("master_weights", yes(master_weights));
  row("loss_scale", !loss_scale                ? "none (1)"
                    : loss_scale->is_dynamic() ? "dynamic"
                                               : std::to_string(loss_scale->value()));
  row("cast_model_outputs", cast_model_outputs ? c10::toString(*cast_model_outputs) : "none");
  row("num_losses", std::to_string(num_losses));
  if (device.is_cuda()) {
    row("allow_tf32", "matmul " + yes(tf32_matmul) + ", conv " + yes(tf32_conv));
  }
  return out.str();
}

namespace {

// Models initialize() has seen, by identity, for the "called twice" error.
// Weak references: a destroyed model frees its entry.
std::mutex g_initialized_mutex;
std::vector<std::weak_ptr<torch::nn::Module>> g_initialized;

void mark_initialized(const std::shared_ptr<torch::nn::Module>& model) {
  std::lock_guard<std::mutex> lock(g_initialized_mutex);
  g_initialized.erase(std::remove_if(g_initialized.begin(), g_initialized.end(),
                                     [](const auto& w) { return w.expired(); }),
                      g_initialized.end());
  for (const auto& w : g_initialized) {
    TORCH_CHECK(w.lock() != model, "ampx::initialize: this model (", model->name(),
                ") was already initialized; initialize() casts parameters and sets up "
                "master weights once, so call it once per model");
  }
  g_initialized.push_back(model);
}

c10::Device model_device(const torch::nn::Module& model) {
  for (const auto& p : model.parameters()) return p.device();
  for (const auto& b : model.buffers()) return b.device();
  return c10::Device(c10::kCPU);
}

AmpProperties resolve(const AmpOptions& o, const c10::Device& device) {
  AmpProperties p;
  p.opt_level = o.opt_level();
  p.device = device;
  p.dtype = o.dtype().value_or(device.is_cuda() ? c10::kHalf : c10::kBFloat16);
  TORCH_CHECK_VALUE(p.dtype == c10::kHalf || p.dtype == c10::kBFloat16,
                    "ampx::initialize: dtype must be float16 or bfloat16, got ", p.dtype);
  const bool fp16 = p.dtype == c10::kHalf;
  // Apex's table. Dynamic scaling is on for fp16 only by default: bf16 has
  // fp32's exponent range, so its gradients do not underflow.
  const auto dynamic_if_fp16 =
      fp16 ? c10::optional<LossScale>(LossScale::dynamic()) : c10::nullopt;
  auto row = [&p](bool cast_model_type, bool patch_torch_functions, bool keep_batchnorm_fp32,
                  bool master_weights, c10::optional<LossScale> loss_scale) {
    p.cast_model_type = cast_model_type;
    p.patch_torch_functions = patch_torch_functions;
    p.keep_batchnorm_fp32 = keep_batchnorm_fp32;
    p.master_weights = master_weights;
    p.loss_scale = loss_scale;
  };
  switch (p.opt_level) {
    case OptLevel::O0:
      row(false, false, false, false, c10::nullopt);
      break;
    case OptLevel::O1:
      row(false, true, false, false, dynamic_if_fp16);
      break;
    case OptLevel::O2:
      row(true, false, true, true, dynamic_if_fp16);
      break;
    case OptLevel::O3:
      row(true, false, false, false, c10::nullopt);
      break;
  }
  if (o.cast_model_type()) p.cast_model_type = *o.cast_model_type();
  if (o.patch_torch_functions()) p.patch_torch_functions = *o.patch_torch_functions();
  if (o.keep_batchnorm_fp32()) p.keep_batchnorm_fp32 = *o.keep_batchnorm_fp32();
  if (o.master_weights()) p.master_weights = *o.master_weights();
  if (o.loss_scale()) p.loss_scale = o.loss_scale();
  p.cast_model_outputs = o.cast_model_outputs();
  p.num_losses = o.num_losses();
  TORCH_CHECK_VALUE(o.num_losses() >= 1, "ampx::initialize: num_losses must be >= 1, got ",
                    o.num_losses());
  TORCH_CHECK_VALUE(!(p.patch_torch_functions && p.cast_model_type),
                    "ampx::initialize: patch_torch_functions (autocast) and cast_model_type "
                    "together are not a valid combination (Apex refuses it too)");
  TORCH_CHECK_VALUE(!p.keep_batchnorm_fp32 || p.cast_model_type,
                    "ampx::initialize: keep_batchnorm_fp32 only applies when the model is cast "
                    "(O2/O3 or cast_model_type)");
  TORCH_CHECK_VALUE(!p.master_weights || p.cast_model_type,
                    "ampx::initialize: master_weights only apply when the model is cast "
                    "(O2/O3 or cast_model_type); at ",
                    ampx::to_string(p.opt_level), " the parameters are fp32 already");
  if (o.min_loss_scale() && p.loss_scale) {
    TORCH_CHECK_VALUE(*o.min_loss_scale() > 0 && *o.min_loss_scale() <= o.max_loss_scale(),
                      "ampx::initialize: min_loss_scale must be in (0, max_loss_scale=",
                      o.max_loss_scale(), "], got ", *o.min_loss_scale());
  }
  return p;
}

// O2/O3 cast the model in place (set_data keeps each parameter's identity,
// so optimizers built on it see the new dtype); O0 casts it to float32.
// Without `parameters`, the buffers alone (a sharded model's parameters
// are its wrapper's to cast).
void cast_model(torch::nn::Module& model, AmpProperties& props, bool parameters = true) {
  const auto dtype = props.cast_model_type ? props.dtype : c10::kFloat;
  torch::NoGradGuard no_grad;
  for (const auto& module : model.modules(/*include_self=*/true)) {
    if (props.cast_model_type && props.keep_batchnorm_fp32 && detail::is_norm_layer(*module)) {
      props.has_fp32_norm_layers = true;
      continue;  // fp32 weights and statistics; fed through the forward guard
    }
    for (auto& p : module->parameters(/*recurse=*/false)) {
      if (!parameters) break;
      if (p.is_floating_point() && p.scalar_type() != dtype) p.set_data(p.data().to(dtype));
    }
    // An FP8 layer's buffers are its scaling state: float32, as TE keeps it.
    if (fp8::scaling_of(*module)) continue;
    for (auto& b : module->buffers(/*recurse=*/false)) {
      if (b.is_floating_point() && b.scalar_type() != dtype) b.set_data(b.data().to(dtype));
    }
  }
}

// Optimizers that already hold per-parameter state (they have stepped) keep
// it in the old dtype: casting under them would silently mix precisions.
// Master weights live in ampx::optim optimizers, which must agree with the
// level about keeping them.
void check_optimizers(const AmpProperties& props,
                      const std::vector<torch::optim::Optimizer*>& optimizers) {
  for (size_t i = 0; i < optimizers.size(); ++i) {
    TORCH_CHECK_VALUE(optimizers[i] != nullptr, "ampx::initialize: optimizers[", i, "] is null");
    TORCH_CHECK(optimizers[i]->state().empty(), "ampx::initialize: optimizers[", i,
                "] already holds state for ", optimizers[i]->state().size(),
                " parameters (it has stepped); call initialize() before training so that "
                "its state is created for the ",
                ampx::to_string(props.opt_level), " parameter dtypes");
    const auto* mixed = dynamic_cast<const optim::MixedPrecisionOptimizer*>(optimizers[i]);
    if (props.master_weights) {
      TORCH_CHECK_VALUE(mixed != nullptr, "ampx::initialize: ", ampx::to_string(props.opt_level),
                        " keeps fp32 master weights, which live in an ampx::optim optimizer "
                        "(AdamW, SGD, LAMB), but optimizers[",
                        i,
                        "] is another torch::optim::Optimizer; use an ampx::optim one, or "
                        "AmpOptions::master_weights(false) to step the low-precision "
                        "parameters directly");
      TORCH_CHECK_VALUE(mixed->config().master_weights,
                        "ampx::initialize: ", ampx::to_string(props.opt_level),
                        " keeps master weights but optimizers[", i, "] (", mixed->name(),
                        ") was built with master_weights(false)");
    } else if (props.cast_model_type && mixed != nullptr && mixed->config().master_weights) {
      TORCH_CHECK_VALUE(false, "ampx::initialize: ", ampx::to_string(props.opt_level),
                        " has no master weights but optimizers[", i, "] (", mixed->name(),
                        ") keeps them (master_weights(true), its default); build it with "
                        "master_weights(false) (and stochastic_rounding(true) for bfloat16), "
                        "or use O2");
    }
  }
}

// Before the cast: masters are snapshots of the fp32 values, not of their
// low-precision roundings.
void capture_master_weights(const AmpProperties& props,
                            const std::vector<torch::optim::Optimizer*>& optimizers) {
  if (!props.master_weights) return;
  for (auto* opt : optimizers) {
    dynamic_cast<optim::MixedPrecisionOptimizer&>(*opt).capture_master_weights();
  }
}

}  // namespace

namespace {
// This thread's innermost live ForwardGuard's properties (ampx::checkpoint).
thread_local std::shared_ptr<const AmpProperties> t_forward_region;
}  // namespace

struct ForwardGuard::Impl {
  std::shared_ptr<const AmpProperties> properties;
  std::shared_ptr<const AmpProperties> outer;  // t_forward_region before this guard
  std::unique_ptr<AutocastGuard> autocast;
  std::unique_ptr<KeepNormsFp32Guard> norms;
  std::unique_ptr<WideProductsGuard> wide;  // made last, dropped first
};

ForwardGuard::ForwardGuard(const AmpProperties& p) : impl_(std::make_unique<Impl>()) {
  impl_->properties = std::make_shared<const AmpProperties>(p);
  impl_->outer = t_forward_region;
  if (p.patch_torch_functions) {
    impl_->autocast = std::make_unique<AutocastGuard>(p.device.type(), p.dtype);
  }
  if (p.cast_model_type && p.keep_batchnorm_fp32 && p.has_fp32_norm_layers) {
    // LibTorch modules have no forward hooks: norm layers get their
    // low-precision inputs in fp32 through the dispatcher (ampx/policy.h).
    impl_->norms = std::make_unique<KeepNormsFp32Guard>(p.device.type());
  }
  // A cast model's 16-bit products where LibTorch's are slower than its
  // float32 ones (cpu_products_are_wide), and its attention through ampx's
  // fused kernel (O1's AutocastGuard makes its own).
  if (p.cast_model_type && p.device.is_cpu() &&
      (cpu_products_are_wide(p.dtype) || detail::routes_fused_attention())) {
    impl_->wide = std::make_unique<WideProductsGuard>();
  }
  t_forward_region = impl_->properties;
}

ForwardGuard::~ForwardGuard() {
  t_forward_region = std::move(impl_->outer);
}

namespace detail {

std::shared_ptr<const AmpProperties> current_forward_region() {
  return t_forward_region;
}

std::shared_ptr<ForwardGuard> enter_forward_region(const AmpProperties& properties) {
  return std::shared_ptr<ForwardGuard>(new ForwardGuard(properties));
}

}  // namespace detail

AmpSession::AmpSession(AmpProperties properties) : properties_(std::move(properties)) {}

GradScaler& AmpSession::scaler(int64_t loss_id) {
  TORCH_CHECK_INDEX(loss_id >= 0 && loss_id < static_cast<int64_t>(scalers_.size()),
                    "AmpSession::scaler: loss_id must be in [0, num_losses=", scalers_.size(),
                    "), got ", loss_id);
  return *scalers_[loss_id];
}

at::Tensor AmpSession::cast_input(const at::Tensor& input) const {
  if (properties_.cast_model_type && input.is_floating_point()) {
    return input.to(properties_.dtype);
  }
  return input;
}

at::Tensor AmpSession::cast_output(const at::Tensor& output) const {
  if (properties_.cast_model_outputs && output.is_floating_point()) {
    return output.to(*properties_.cast_model_outputs);
  }
  return output;
}

std::map<std::string, StateDict> AmpSession::state_dict() const {
  std::map<std::string, StateDict> out;
  for (size_t i = 0; i < scalers_.size(); ++i) {
    out["loss_scaler" + std::to_string(i)] = scalers_[i]->state_dict();
  }
  return out;
}

void AmpSession::load_state_dict(const std::map<std::string, StateDict>& state) {
  for (size_t i = 0; i < scalers_.size(); ++i) {
    const auto key = "loss_scaler" + std::to_string(i);
    TORCH_CHECK(state.count(key), "AmpSession::load_state_dict: missing '", key,
                "' (the state has ", state.size(),
                " scalers; this AmpSession has num_losses=", scalers_.size(), ")");
  }
  TORCH_CHECK(state.size() == scalers_.size(), "AmpSession::load_state_dict: the state has ",
              state.size(), " loss scalers, this AmpSession has num_losses=", scalers_.size());
  // All or nothing: every enabled scaler's dict is validated on a probe first.
  for (size_t i = 0; i < scalers_.size(); ++i) {
    if (scalers_[i]->is_enabled()) {
      GradScaler probe;
      probe.load_state_dict(state.at("loss_scaler" + std::to_string(i)));
    }
  }
  for (size_t i = 0; i < scalers_.size(); ++i) {
    scalers_[i]->load_state_dict(state.at("loss_scaler" + std::to_string(i)));
  }
}

namespace {

// Used by both initialize()s: the tf32 settings, the session and its scalers.
void apply_tf32(const AmpOptions& options, AmpProperties& props) {
  if (options.allow_tf32()) {
    at::globalContext().setAllowTF32CuBLAS(*options.allow_tf32());
    at::globalContext().setAllowTF32CuDNN(*options.allow_tf32());
  }
  props.tf32_matmul = at::globalContext().allowTF32CuBLAS();
  props.tf32_conv = at::globalContext().allowTF32CuDNN();
}

std::vector<std::unique_ptr<GradScaler>> make_scalers(const AmpProperties& props,
                                                      const AmpOptions& options) {
  std::vector<std::unique_ptr<GradScaler>> scalers;
  for (int64_t i = 0; i < props.num_losses; ++i) {
    GradScalerOptions so;
    if (!props.loss_scale) {
      so.enabled(false);
    } else if (props.loss_scale->is_dynamic()) {
      so.max_scale(options.max_loss_scale()).min_scale(options.min_loss_scale());
    } else {  // fixed: both bounds pinned to the value
      const double v = props.loss_scale->value();
      so.init_scale(v).min_scale(v).max_scale(v);
    }
    scalers.push_back(std::make_unique<GradScaler>(so));
  }
  return scalers;
}

}  // namespace

AmpSession initialize(const std::shared_ptr<torch::nn::Module>& model,
                      const std::vector<torch::optim::Optimizer*>& optimizers,
                      const AmpOptions& options) {
  TORCH_CHECK_VALUE(model != nullptr, "ampx::initialize: model is null");
  const auto device = model_device(*model);
  AmpProperties props = resolve(options, device);
  check_optimizers(props, optimizers);
  if (props.patch_torch_functions && device.is_cpu() && props.dtype == c10::kHalf) {
    AutocastGuard probe(c10::kCPU, c10::kHalf);  // 1.13: a clear error, here and now
  }
  apply_tf32(options, props);
  mark_initialized(model);
  capture_master_weights(props, optimizers);
  cast_model(*model, props);
  AmpSession amp(props);
  amp.scalers_ = make_scalers(props, options);
  return amp;
}

namespace detail {

AmpSession initialize_sharded(const std::shared_ptr<torch::nn::Module>& model,
                              const AmpOptions& options, c10::ScalarType param_dtype,
                              bool norms_fp32) {
  TORCH_CHECK_VALUE(model != nullptr, "ampx::initialize: model is null");
  const auto device = model_device(*model);
  AmpProperties props = resolve(options, device);
  const auto level = ampx::to_string(props.opt_level);
  TORCH_CHECK_VALUE(!props.cast_model_type || props.master_weights, "ampx::initialize: ", level,
                    " keeps no fp32 master weights, but a FullyShardedDataParallel model keeps "
                    "its shards as fp32 masters; use O2 (its parameters gathered in ",
                    props.dtype, ")");
  if (props.cast_model_type) {
    TORCH_CHECK_VALUE(param_dtype == props.dtype, "ampx::initialize: ", level, " computes in ",
                      props.dtype,
                      ", but the FullyShardedDataParallel gathers its parameters in param_dtype ",
                      param_dtype, "; build it with param_dtype ", props.dtype);
    TORCH_CHECK_VALUE(norms_fp32 == props.keep_batchnorm_fp32, "ampx::initialize: ", level,
                      " has keep_batchnorm_fp32 ", props.keep_batchnorm_fp32 ? "true" : "false",
                      ", but the FullyShardedDataParallel has keep_norms_fp32 ",
                      norms_fp32 ? "true" : "false", "; make them agree");
  } else {
    TORCH_CHECK_VALUE(param_dtype == c10::kFloat, "ampx::initialize: ", level,
                      " computes with float32 weights (O1: under autocast), but the "
                      "FullyShardedDataParallel gathers its parameters in param_dtype ",
                      param_dtype, ", which is O2's model cast; use O2, or param_dtype float32");
  }
  if (props.patch_torch_functions && device.is_cpu() && props.dtype == c10::kHalf) {
    AutocastGuard probe(c10::kCPU, c10::kHalf);  // 1.13: a clear error, here and now
  }
  apply_tf32(options, props);
  mark_initialized(model);
  // The parameters are the wrapper's; the buffers are cast as the level casts them.
  cast_model(*model, props, /*parameters=*/false);
  AmpSession amp(props);
  amp.scalers_ = make_scalers(props, options);
  return amp;
}

}  // namespace detail

AmpSession initialize(const std::shared_ptr<torch::nn::Module>& model,
                      torch::optim::Optimizer& optimizer, OptLevel opt_level) {
  return initialize(model, {&optimizer}, AmpOptions(opt_level));
}

}  // namespace ampx
