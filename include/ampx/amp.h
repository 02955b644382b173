#pragma once

/// \file
/// Apex-style opt levels: one call that casts the model, sets up master
/// weights and loss scaling, and says how the forward pass runs.
///
/// ```
///   auto model = std::make_shared<Net>();
///   ampx::optim::AdamW opt(model->parameters(), ampx::optim::AdamWOptions(1e-3));
///   auto amp = ampx::initialize(model, opt, ampx::OptLevel::O2);  // bf16 on CPU
///   for (...) {
///     opt.zero_grad();
///     torch::Tensor loss;
///     {
///       auto forward = amp.forward_guard();             // norms fp32 (O2) / autocast (O1)
///       loss = loss_fn(model->forward(amp.cast_input(x)), y);
///     }
///     amp.scaler().scale(loss).backward();
///     amp.scaler().step(opt);                           // masters updated, bf16 written back
///     amp.scaler().update();
///   }
/// ```
///
/// | level | params cast to | autocast op casting | norms fp32 | master weights | loss scale |
/// | ----- | -------------- | ------------------- | ---------- | -------------- | ---------- |
/// | O0    | fp32           | no                  | -          | no             | 1          |
/// | O1    | unchanged      | yes                 | -          | no             | dynamic    |
/// | O2    | low precision  | no                  | yes        | yes (fp32)     | dynamic    |
/// | O3    | low precision  | no                  | no         | no             | 1          |
///
/// "dynamic" loss scaling defaults off for bfloat16 (its range is fp32's) and
/// can be forced on with AmpOptions::loss_scale.

#include "ampx/grad_scaler.h"

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace ampx {

/// Apex's opt levels (the table at the top of this header).
enum class OptLevel {
  O0,  ///< fp32 training: the model cast to float32, no autocast, no loss scaling
  O1,  ///< autocast casts the forward's ops; parameters stay fp32
  O2,  ///< parameters cast to 16 bits except norm layers, fp32 master weights
  O3,  ///< everything in 16 bits: no master weights, no loss scaling
};

/// "O0".."O3" (case-sensitive, as in Apex); anything else is an error.
OptLevel parse_opt_level(const std::string& name);
/// "O0".."O3".
std::string to_string(OptLevel level);

/// Apex's loss_scale: "dynamic" or a fixed number.
class LossScale {
 public:
  /// A scale that GradScaler grows and backs off (Apex's "dynamic").
  static LossScale dynamic() { return LossScale(true, 0.0); }
  /// A scale that never changes. Steps whose gradients overflow are still
  /// skipped (Apex would apply them).
  static LossScale fixed(double value);
  /// Whether this is the dynamic scale.
  bool is_dynamic() const { return dynamic_; }
  /// The fixed scale; 0 for the dynamic one.
  double value() const { return value_; }

 private:
  LossScale(bool dynamic, double value) : dynamic_(dynamic), value_(value) {}
  bool dynamic_;
  double value_;
};

/// What initialize() sets up: an opt level and Apex's overrides of it, set
/// by chained calls: `AmpOptions(OptLevel::O2).loss_scale(LossScale::fixed(128))`.
struct AmpOptions {
  /// Options of `opt_level` with none of its properties overridden.
  explicit AmpOptions(OptLevel opt_level = OptLevel::O1) : opt_level_(opt_level) {}
  /// The level whose table row the other fields start from.
  TORCH_ARG(OptLevel, opt_level);
  /// Low-precision dtype: float16 or bfloat16 (default: bf16 on CPU, fp16 on CUDA).
  TORCH_ARG(c10::optional<c10::ScalarType>, dtype) = c10::nullopt;
  /// The fields below override the level's value when set (Apex's overrides).
  TORCH_ARG(c10::optional<bool>, cast_model_type) = c10::nullopt;        ///< cast params (O2/O3)
  TORCH_ARG(c10::optional<bool>, patch_torch_functions) = c10::nullopt;  ///< autocast (O1)
  TORCH_ARG(c10::optional<bool>, keep_batchnorm_fp32) = c10::nullopt;    ///< all norm layers
  /// fp32 master weights in the optimizers (O2); needs a cast model.
  TORCH_ARG(c10::optional<bool>, master_weights) = c10::nullopt;
  /// Dynamic or fixed loss scaling instead of the level's (dynamic for
  /// float16 at O1 and O2, none otherwise).
  TORCH_ARG(c10::optional<LossScale>, loss_scale) = c10::nullopt;
  /// dtype that amp.cast_output() returns (Apex's cast_model_outputs).
  TORCH_ARG(c10::optional<c10::ScalarType>, cast_model_outputs) = c10::nullopt;
  /// Floor of the dynamic scale (Apex's min_loss_scale; none by default).
  TORCH_ARG(c10::optional<double>, min_loss_scale) = c10::nullopt;
  /// Ceiling of the dynamic scale (Apex's max_loss_scale, 2^24; a plain
  /// GradScaler has none, as PyTorch's).
  TORCH_ARG(double, max_loss_scale) = 16777216.0;
  /// One loss scaler per loss (Apex's num_losses / loss_id).
  TORCH_ARG(int64_t, num_losses) = 1;
  /// TF32 tensor-core math for fp32 matrix products (cuBLAS) and
  /// convolutions (cuDNN) on Ampere and later GPUs: a 10-bit mantissa in the
  /// products, fp32 accumulation. Set, it sets both LibTorch switches
  /// (torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32);
  /// unset, LibTorch's own defaults stay (as PyTorch's: products off,
  /// convolutions on). No effect on the CPU.
  TORCH_ARG(c10::optional<bool>, allow_tf32) = c10::nullopt;
};

/// What a level plus overrides resolved to.
struct AmpProperties {
  OptLevel opt_level;                   ///< the level asked for
  c10::Device device{c10::kCPU};        ///< the model's device
  c10::ScalarType dtype;                ///< the low-precision dtype: float16 or bfloat16
  bool cast_model_type;                 ///< parameters cast to `dtype` (O2/O3)
  bool patch_torch_functions;           ///< the forward runs under autocast (O1)
  bool keep_batchnorm_fp32;             ///< norm layers kept in fp32 (O2)
  bool master_weights;                  ///< fp32 master weights in the optimizers (O2)
  c10::optional<LossScale> loss_scale;  ///< nullopt: no scaling (scale 1)
  c10::optional<c10::ScalarType> cast_model_outputs;  ///< see AmpOptions::cast_model_outputs
  int64_t num_losses;                                 ///< loss scalers, one per loss
  /// TF32 in effect after initialize(): fp32 products (cuBLAS), convolutions (cuDNN).
  bool tf32_matmul = false;
  bool tf32_conv = false;  ///< TF32 for fp32 convolutions (cuDNN) after initialize()
  /// Whether the model has norm layers that keep_batchnorm_fp32 left in fp32:
  /// only then does the O2 forward guard route them (a model without norm
  /// layers skips the guard's dispatcher registrations).
  bool has_fp32_norm_layers = false;
  /// A two-column table, one property a line, for logs.
  std::string to_string() const;
};

class ForwardGuard;

namespace detail {
/// The properties of this thread's innermost live ForwardGuard (null: none),
/// and that region entered again until the result is dropped: what
/// ampx::checkpoint (ampx/checkpoint.h) records at its forward and enters
/// for its recompute in backward.
std::shared_ptr<const AmpProperties> current_forward_region();
std::shared_ptr<ForwardGuard> enter_forward_region(const AmpProperties& properties);
}  // namespace detail

/// The forward-pass region of an opt level: autocast (O1), norm layers fed in
/// fp32 (O2), nothing (O0, O3); with a cast model (O2, O3) on a CPU whose
/// 16-bit products LibTorch runs in a scalar loop, also a WideProductsGuard
/// (ampx/policy.h; O1's AutocastGuard makes its own). Returned by
/// AmpSession::forward_guard(); RAII.
class ForwardGuard {
 public:
  ~ForwardGuard();
  ForwardGuard(const ForwardGuard&) = delete;
  ForwardGuard& operator=(const ForwardGuard&) = delete;
  ForwardGuard(ForwardGuard&&) = delete;
  ForwardGuard& operator=(ForwardGuard&&) = delete;

 private:
  friend class AmpSession;
  friend std::shared_ptr<ForwardGuard> detail::enter_forward_region(const AmpProperties&);
  explicit ForwardGuard(const AmpProperties& properties);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class AmpSession;

namespace detail {
/// initialize() for a model whose parameters another part of ampx casts and
/// keeps fp32 masters of (ampx::dist::FullyShardedDataParallel gathers them
/// in `param_dtype`, norm layers in fp32 when `norms_fp32`): checks that the
/// level agrees with that, casts the floating buffers as the level does, and
/// sets up the scalers and the forward region. ampx/fsdp.h's initialize()
/// overload is the public way in.
AmpSession initialize_sharded(const std::shared_ptr<torch::nn::Module>& model,
                              const AmpOptions& options, c10::ScalarType param_dtype,
                              bool norms_fp32);
}  // namespace detail

/// One model's mixed-precision training as initialize() set it up: the
/// resolved level (properties()), the loss scalers it owns, the forward region.
class AmpSession {
 public:
  /// What the level and its overrides resolved to.
  const AmpProperties& properties() const { return properties_; }
  /// The scaler of loss `loss_id` (disabled, i.e. scale 1, when the level has
  /// no loss scaling).
  GradScaler& scaler(int64_t loss_id = 0);
  /// Enter the level's forward region (C++17 guaranteed elision: `auto g = amp.forward_guard();`).
  ForwardGuard forward_guard() const { return ForwardGuard(properties_); }
  /// Casts a floating input to the model's parameter dtype (O2/O3; Apex casts
  /// model inputs in its patched forward, which C++ modules cannot have).
  at::Tensor cast_input(const at::Tensor& input) const;
  /// Casts a floating output to cast_model_outputs, if set.
  at::Tensor cast_output(const at::Tensor& output) const;
  /// "loss_scaler0".."loss_scalerN" -> each scaler's state dict (Apex's keys).
  std::map<std::string, StateDict> state_dict() const;
  /// Loads what state_dict() returned: one entry per scaler, every one
  /// checked before any scaler is changed.
  void load_state_dict(const std::map<std::string, StateDict>& state);

 private:
  friend AmpSession initialize(const std::shared_ptr<torch::nn::Module>&,
                               const std::vector<torch::optim::Optimizer*>&, const AmpOptions&);
  friend AmpSession detail::initialize_sharded(const std::shared_ptr<torch::nn::Module>&,
                                               const AmpOptions&, c10::ScalarType, bool);
  explicit AmpSession(AmpProperties properties);
  AmpProperties properties_;
  std::vector<std::unique_ptr<GradScaler>> scalers_;
};

/// Resolves `options` against the level's table, casts `model` (O2: every
/// floating parameter and buffer except those of norm layers; O3: all), and
/// sets up master weights in the optimizers (ampx::optim optimizers capture
/// fp32 copies before the cast) and the loss scalers. Call once per model,
/// after building the optimizers and before training.
AmpSession initialize(const std::shared_ptr<torch::nn::Module>& model,
                      const std::vector<torch::optim::Optimizer*>& optimizers,
                      const AmpOptions& options);
/// The same for one optimizer and a level without overrides.
AmpSession initialize(const std::shared_ptr<torch::nn::Module>& model,
                      torch::optim::Optimizer& optimizer, OptLevel opt_level);

}  // namespace ampx
