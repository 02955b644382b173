#pragma once

/// \file
/// FP8 scaling recipes with Transformer Engine's semantics: delayed scaling
/// (the scale for this step comes from the amax history of the steps before)
/// and current scaling (the scale comes from the tensor being cast).
///
/// ```
///   auto recipe = ampx::fp8::DelayedScaling().amax_history_len(16).margin(0);
///   ampx::fp8::DelayedScalingState input(recipe, ampx::Direction::kForward);
///   input.scale();                         // 1.0 before any step
///   auto codes = ampx::fp8::quantize(x, input.format(), input.scale());
///   input.update(ampx::fp8::compute_amax(x));      // x's amax 2.0 -> scale 448 / 2 = 224
/// ```
///
/// Delayed scaling, as TE's amax_and_scale_update does it (history length L):
///
/// ```
///   - the step's amax enters the history and the window is the last L amaxes,
///     this step's included; amax_compute_algo picks max over the window
///     (NaN entries ignored, as CUDA's fmaxf does) or the most recent one;
///   - scale = (fp8_max * 2^-margin) / amax in float32, only when that amax is
///     finite and > 0; otherwise the previous scale stays; a scale that
///     overflows float32 (tiny amax) becomes FLT_MAX; scale_inv = 1 / scale;
///   - a step whose amax is exactly 0 (the tensor was all zeros or not seen)
///     changes nothing, neither history nor scale, as TE's fused update after
///     amax reduction (the one its PyTorch modules run) skips it.
/// ```
/// The history is stored in TE's layout: [L] float32, the oldest kept amax at
/// index 1, the newest at index L - 1, index 0 the zeroed slot TE writes the
/// next step's amax into.
///
/// Everything is ATen ops on the state's device: update() never syncs with the
/// host on CUDA.
///
/// TensorScaling and LinearScaling (at the end) are the states an FP8 layer
/// keeps per role (input, weight, output gradient) under either recipe.

#include "ampx/direction.h"
#include "ampx/fp8/autocast.h"
#include "ampx/fp8/block_recipe.h"
#include "ampx/fp8/cast.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
namespace serialize {
class InputArchive;
class OutputArchive;
}  // namespace serialize
}  // namespace torch

namespace ampx {
namespace dist {
class ProcessGroup;
}  // namespace dist

namespace fp8 {

/// TE's `amax_compute_algo` (its callable form is not offered).
enum class AmaxComputeAlgo {
  kMax,         ///< "max": the largest amax in the history window
  kMostRecent,  ///< "most_recent": this step's amax
};

/// The element format `recipe_format` gives `pass`.
Fp8Format format_for(RecipeFormat recipe_format, Direction pass);

/// The largest absolute value of x as a float32 tensor of one element (on x's
/// device, no host sync). NaN in x gives NaN.
[[nodiscard]] at::Tensor compute_amax(const at::Tensor& x);

/// Options of the delayed scaling recipe; defaults are TE's (2.x).
struct DelayedScaling {
  /// Throws c10::Error on invalid options (pure E5M2, history length < 1,
  /// negative margin).
  void validate() const;

  /// Scale headroom: scale = fp8_max / amax / 2^margin.
  TORCH_ARG(int64_t, margin) = 0;
  /// HYBRID (default) or E4M3; E5M2 is refused when a state is made from it.
  TORCH_ARG(RecipeFormat, fp8_format) = RecipeFormat::kHybrid;
  /// Length of the amax history window (TE >= 1.0: 1024; TE 0.x: 1).
  TORCH_ARG(int64_t, amax_history_len) = 1024;
  /// How the window's amaxes become the one the scale is computed from.
  TORCH_ARG(AmaxComputeAlgo, amax_compute_algo) = AmaxComputeAlgo::kMax;
};

/// The delayed scaling state of one tensor role (e.g. a layer's input, weight
/// or output gradient): its amax history, scale and scale_inv, all float32 on
/// `device`. Starts with scale 1 and an all-zero history, as TE does.
class DelayedScalingState {
 public:
  /// The state of a role of `pass` under `recipe` (checked: see
  /// DelayedScaling::validate()), on `device`.
  DelayedScalingState(const DelayedScaling& recipe, Direction pass,
                      c10::Device device = c10::Device(c10::DeviceType::CPU));

  /// Records this step's amax (a float32 tensor of one element, on the
  /// state's device) and computes the scale the next step casts with.
  void update(const at::Tensor& amax);

  /// The element format: the recipe's for this state's pass.
  Fp8Format format() const { return format_; }
  /// fp8_max / 2^margin: what the amax is mapped to.
  float scaled_max() const { return scaled_max_; }
  /// The recipe the state was made with.
  const DelayedScaling& recipe() const { return recipe_; }
  /// [amax_history_len] float32, TE's layout (see the top of this header).
  const at::Tensor& amax_history() const { return amax_history_; }
  /// float32 of shape [1]: multiplies x before the cast.
  const at::Tensor& scale() const { return scale_; }
  /// float32 of shape [1]: 1 / scale, multiplies the codes' values back.
  const at::Tensor& scale_inv() const { return scale_inv_; }

  /// Writes history, scale and scale_inv under `<prefix>.amax_history` etc.,
  /// with `<prefix>.version` and the recipe's settings.
  void save(torch::serialize::OutputArchive& archive, const std::string& prefix) const;
  /// Restores what save() wrote, bitwise, onto this state's device; the
  /// recipe's settings must match this state's.
  void load(torch::serialize::InputArchive& archive, const std::string& prefix);

 private:
  DelayedScaling recipe_;
  Fp8Format format_;
  float scaled_max_;
  at::Tensor amax_history_;
  at::Tensor scale_;
  at::Tensor scale_inv_;
};

/// Options of TE's Float8CurrentScaling: each tensor is cast with the scale
/// of its own amax, computed just before the cast.
struct CurrentScaling {
  /// Throws c10::Error on invalid options (pure E5M2, negative amax_epsilon).
  void validate() const;

  /// HYBRID (default) or E4M3; E5M2 is refused.
  TORCH_ARG(RecipeFormat, fp8_format) = RecipeFormat::kHybrid;
  /// Round the scale down to a power of two (TE: NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES).
  TORCH_ARG(bool, power_2_scale) = false;
  /// Floor for the amax (TE's QParams.amax_epsilon).
  TORCH_ARG(double, amax_epsilon) = 0.0;
};

/// TE's compute_scale_from_amax: amax floored at amax_epsilon; scale 1 when
/// that amax is 0, inf or NaN; else fp8_max / amax in float32, FLT_MAX where
/// that overflows, truncated to a power of two with power_2_scale. amax: a
/// float32 tensor of one element; the result has its shape and device.
[[nodiscard]] at::Tensor current_scale(const at::Tensor& amax, Fp8Format format,
                                       const CurrentScaling& recipe);

/// A tensor cast with its own scale: an Fp8Tensor (codes, scale_inv, format)
/// and the scale it was cast with ([1] float32, like scale_inv).
struct CurrentScaled : Fp8Tensor {
  at::Tensor scale;  ///< [1] float32: what x was multiplied by before the cast
};

/// Current scaling of x for `pass`: compute_amax(x) -> current_scale -> quantize.
[[nodiscard]] CurrentScaled quantize_current(const at::Tensor& x, const CurrentScaling& recipe,
                                             Direction pass);

/// One of the recipes, as a layer takes it: converts implicitly from each,
/// so `LinearOptions(768, 768).recipe(CurrentScaling())` works. Delayed and
/// current scaling scale whole tensors (the roles below); the block-scaled
/// recipes (ampx/fp8/block_recipe.h) scale blocks.
class Recipe {
 public:
  /// Which recipe a Recipe holds.
  enum class Kind {
    kDelayed,      ///< DelayedScaling
    kCurrent,      ///< CurrentScaling
    kMxfp8,        ///< MXFP8BlockScaling
    kNvfp4,        ///< NVFP4BlockScaling
    kFloat8Block,  ///< Float8BlockScaling
  };

  Recipe() = default;  ///< DelayedScaling's defaults
  /// Delayed scaling with `delayed`'s options.
  Recipe(const DelayedScaling& delayed);  // NOLINT(google-explicit-constructor)
  /// Current scaling with `current`'s options.
  Recipe(const CurrentScaling& current);  // NOLINT(google-explicit-constructor)
  /// MXFP8 block scaling with `mxfp8`'s options.
  Recipe(const MXFP8BlockScaling& mxfp8);  // NOLINT(google-explicit-constructor)
  /// NVFP4 block scaling with `nvfp4`'s options.
  Recipe(const NVFP4BlockScaling& nvfp4);  // NOLINT(google-explicit-constructor)
  /// FP8 block scaling (1 x 128, 128 x 128) with `block`'s options.
  Recipe(const Float8BlockScaling& block);  // NOLINT(google-explicit-constructor)

  /// Which recipe this is.
  Kind kind() const { return kind_; }
  /// Whether this is delayed scaling.
  bool is_delayed() const { return kind_ == Kind::kDelayed; }
  /// Whether this is one of the block-scaled recipes.
  bool is_block() const {
    return kind_ == Kind::kMxfp8 || kind_ == Kind::kNvfp4 || kind_ == Kind::kFloat8Block;
  }
  /// The delayed-scaling options; throws c10::Error for another recipe.
  const DelayedScaling& delayed() const;
  /// The current-scaling options; throws c10::Error for another recipe.
  const CurrentScaling& current() const;
  /// The MXFP8 options; throws c10::Error for another recipe.
  const MXFP8BlockScaling& mxfp8() const;
  /// The NVFP4 options; throws c10::Error for another recipe.
  const NVFP4BlockScaling& nvfp4() const;
  /// The FP8 block-scaling options; throws c10::Error for another recipe.
  const Float8BlockScaling& float8_block() const;
  /// The fp8_format of a tensorwise or MXFP8 recipe (kE4M3 for FP8 block
  /// scaling); throws c10::Error for NVFP4, which has none.
  RecipeFormat fp8_format() const;
  /// Throws c10::Error on invalid options (see the recipes' validate()).
  void validate() const;
  /// e.g. "delayed(hybrid, history 1024, max, margin 0)", "current(e4m3)",
  /// "mxfp8(e4m3, rceil)".
  std::string to_string() const;

 private:
  Kind kind_ = Kind::kDelayed;
  DelayedScaling delayed_options_;
  CurrentScaling current_options_;
  MXFP8BlockScaling mxfp8_options_;
  NVFP4BlockScaling nvfp4_options_;
  Float8BlockScaling float8_block_options_;
};

/// The scaling of one tensor role of an FP8 layer (its input, its weight or
/// its output gradient) under the layer's recipe. Delayed scaling: the cast
/// uses the scale the history of the steps before gives, and each cast's
/// amax feeds the next. Current scaling: each cast uses its own amax; the
/// tensors below then hold the last cast's amax, scale and scale_inv.
class TensorScaling : public std::enable_shared_from_this<TensorScaling> {
 public:
  /// The scaling of a role of `pass` under `recipe`, its tensors on `device`.
  TensorScaling(const Recipe& recipe, Direction pass, c10::Device device);

  /// The recipe the role was made with.
  const Recipe& recipe() const { return recipe_; }
  /// The element format: the recipe's for this role's pass.
  Fp8Format format() const { return format_; }
  /// The delayed-scaling state; throws c10::Error under current scaling.
  DelayedScalingState& delayed_state();
  /// float32 [1]. Delayed: the scale the next cast uses. Current: the last cast's.
  const at::Tensor& scale() const;
  /// float32 [1]: 1 / scale().
  const at::Tensor& scale_inv() const;
  /// float32 [1]: the amax of the last recorded cast (after the amax
  /// reduction, where there is one); 0 before the first.
  const at::Tensor& last_amax() const { return last_amax_; }
  /// The tensors that make up the state, by name suffix (for module buffers):
  /// delayed: amax_history, scale, scale_inv; current: amax, scale, scale_inv.
  std::vector<std::pair<std::string, at::Tensor>> state_tensors() const;

  /// Casts x (any floating dtype) with this role's scale: one-byte codes,
  /// the scale_inv they decode with, this role's format. When `record`, the
  /// amax of x is recorded: at once, or, while `group` is set, at the next
  /// reduction (see Fp8AutocastOptions::amax_reduction_group in
  /// ampx/fp8/autocast.h). On CUDA the codes and the amax come from one
  /// pass over x; where `transposed` is given and x is 2-D, that pass also
  /// writes the codes of x^T into it (the column-major operand of an FP8
  /// product), elsewhere it is left undefined.
  Fp8Tensor cast(const at::Tensor& x, bool record, const dist::ProcessGroup* group,
                 at::Tensor* transposed = nullptr);
  /// cast() of a weight, under `casts` (see WeightCasts): kFirstMicroBatch
  /// casts and keeps the cast; kLaterMicroBatch gives the kept codes (and
  /// transpose) again while w is the tensor they were cast from, with the
  /// same storage and unchanged by its version counter, and `record` records
  /// the amax they were cast with, as a cast would; kEveryForward casts, and
  /// drops what was kept where it records. Under c10::InferenceMode: cast().
  Fp8Tensor cast_weight(const at::Tensor& w, WeightCasts casts, bool record,
                        const dist::ProcessGroup* group, at::Tensor* transposed = nullptr);
  /// Records an amax: delayed scaling updates the history and the next scale.
  void record(const at::Tensor& amax);

  /// The scale and scale_inv (float32 [1] each) a cast of a tensor whose
  /// amax is `amax` (float32 [1]) gets now: delayed scaling, the state's
  /// (copies: the next update writes the state in place); current scaling,
  /// current_scale() of `amax` and its inverse. What a cast of the weight
  /// made elsewhere uses (give_weight()).
  std::pair<at::Tensor, at::Tensor> scales_for(const at::Tensor& amax) const;
  /// Gives a cast of the weight `w` made elsewhere: a sharding wrapper's FP8
  /// all-gather (ampx/fsdp.h), where each rank casts its shard of the
  /// weight with scales_for() the whole weight's amax and the ranks gather
  /// the codes. Until drop_given_weight() (or until w changes, as for a kept
  /// cast), cast_weight(w, ...) gives `codes` (uint8, w's shape) with
  /// `scale_inv`, whatever its WeightCasts, without reading w's values, and
  /// `record` records `amax`, the whole weight's, as a cast of w would. On
  /// CUDA the transpose's codes are made from `codes` when asked.
  void give_weight(const at::Tensor& w, const at::Tensor& codes, const at::Tensor& scale,
                   const at::Tensor& scale_inv, const at::Tensor& amax);
  /// Forgets what give_weight() gave.
  void drop_given_weight() { given_.reset(); }

 private:
  struct Fresh;
  struct Kept;
  // x cast with this role's scale, nothing recorded; the amax where
  // `with_amax` or the recipe needs it (current scaling); on CUDA the codes
  // of x^T too where `transpose` and x is 2-D.
  Fresh fresh(const at::Tensor& x, bool with_amax, bool transpose);
  // Refuses an amax reduction group under current scaling.
  void check_group(const dist::ProcessGroup* group) const;
  // Records what `cast` saw, as cast() does after casting.
  void note(const Fresh& cast, const dist::ProcessGroup* group);
  // cast_weight() of the weight give_weight() gave.
  Fp8Tensor give(bool record, const dist::ProcessGroup* group, at::Tensor* transposed);
  // Records amax now, or defers it to `group`'s reduction.
  void record_amax(at::Tensor amax, const dist::ProcessGroup* group);

  Recipe recipe_;
  Fp8Format format_;
  std::unique_ptr<DelayedScalingState> delayed_;
  at::Tensor last_amax_, scale_, scale_inv_;  // current scaling (scale_: delayed's own)
  std::shared_ptr<Kept> kept_;                 // cast_weight's last cast
  std::shared_ptr<Kept> given_;                // give_weight's
};

/// What a sharding wrapper puts in place of a weight whose codes it gave an
/// FP8 layer (TensorScaling::give_weight()): a tensor of the weight's shape,
/// dtype and device holding one NaN and no other byte (every stride 0), so
/// that anything reading it instead of the codes computes NaN, never a
/// plausible number; ampx::fp8::Linear and the FP8 casts refuse it outright.
[[nodiscard]] at::Tensor weight_stand_in(at::IntArrayRef shape, const at::TensorOptions& options);
/// Whether `w` is such a stand-in: more than one element, every stride 0.
bool is_weight_stand_in(const at::Tensor& w);

/// The formats a block-scaled layer's weight is quantized in under `recipe`
/// (ampx/fp8/block_recipe.h): for its forward product (blocks along its
/// rows, 1 x n or, for 2-D blocks, m x n) and for its input-gradient
/// product (blocks down its columns, n x 1; for 2-D blocks the forward's
/// quantization serves both, and `shared` is true).
struct BlockWeightFormats {
  BlockFormat forward = BlockFormat::mxfp8();   ///< the forward product's
  BlockFormat backward = BlockFormat::mxfp8();  ///< the input gradient's
  bool shared = false;                          ///< one quantization for both
};
/// The weight formats of a block-scaled `recipe`; throws c10::Error for
/// delayed and current scaling.
BlockWeightFormats block_weight_formats(const Recipe& recipe);

/// A block-scaled layer's weight quantized elsewhere
/// (LinearScaling::give_block_weight()).
struct GivenBlockWeight {
  /// What stands for `w`.
  explicit GivenBlockWeight(const at::Tensor& w) : weight(w.getIntrusivePtr()) {}
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> weight;  ///< stood in for
  BlockTensor forward;   ///< in BlockWeightFormats::forward
  BlockTensor backward;  ///< in BlockWeightFormats::backward
};

/// The three roles of an FP8 linear layer, all under one recipe.
struct LinearScaling {
  /// The three roles under `recipe`, their tensors on `device`; a
  /// block-scaled recipe has no roles (null), and NVFP4 with stochastic
  /// rounding a stream picked by the recipe's seed and the bits of
  /// `weight`, the layer's initial weight (the same layer, the same stream).
  LinearScaling(const Recipe& recipe, c10::Device device, const at::Tensor& weight = {});
  Recipe recipe;  ///< the layer's recipe
  ///@{
  /// The roles: input and weight (forward), output gradient (backward);
  /// null under a block-scaled recipe.
  std::shared_ptr<TensorScaling> input, weight, grad_output;
  ///@}
  /// NVFP4's stochastic rounding: int64 [2], the layer's stream (drawn from
  /// its first weights by the layer) and how many numbers it has used;
  /// undefined otherwise.
  at::Tensor rounding;
  /// Registers every state tensor as a buffer of `module`, named
  /// `<prefix><role>_<suffix>` (e.g. "fp8_input_amax_history"; NVFP4's
  /// `<prefix>rounding`), so that torch::save/load and .to(device) carry them.
  void register_buffers(torch::nn::Module& module, const std::string& prefix) const;

  /// Gives a block-scaled layer the quantizations of its weight `w` made
  /// elsewhere: a sharding wrapper's gather of codes and scales
  /// (ampx/fsdp.h), where each rank quantizes its rows of the weight and the
  /// ranks gather them. Until drop_given_block_weight(), the layer's
  /// forward with `w` (the same tensor) multiplies `forward` instead of
  /// quantizing w, and saves `backward` for its input gradient, without
  /// reading them or w's values now: a wrapper may fill their storage later,
  /// before the backward. Formats as block_weight_formats() of the recipe.
  void give_block_weight(const at::Tensor& w, BlockTensor forward, BlockTensor backward);
  /// Forgets what give_block_weight() gave.
  void drop_given_block_weight() { given_block_.reset(); }
  /// What give_block_weight() gave for `w`, else null.
  const GivenBlockWeight* given_block_weight(const at::Tensor& w) const;

 private:
  std::shared_ptr<GivenBlockWeight> given_block_;
};

}  // namespace fp8
}  // namespace ampx
