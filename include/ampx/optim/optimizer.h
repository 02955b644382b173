#pragma once

/// \file
/// MixedPrecisionOptimizer: what ampx's optimizers (AdamW, SGD, LAMB) share.
/// FP32 master weights for low-precision params, FP32 states, one fused pass
/// per parameter, scaler-aware steps and position-keyed state files.
///
/// ```
///   auto opt = ampx::optim::AdamW(model->parameters(), ampx::optim::AdamWOptions(3e-4));
///   opt.capture_master_weights();   // while the params are still fp32 (initialize() does it)
///   for (auto& p : model->parameters()) p.set_data(p.to(torch::kBFloat16));
///   ... scaler.step(opt);            // grads unscaled and checked inside the step
/// ```
///
/// Params may be float32, bfloat16 or float16, their grads of the same dtype:
///
/// ```
///   fp32 param:           updated in place; states fp32.
///   bf16/fp16 param:      fp32 master (captured or made from the param at its
///                         first step) updated, then rounded to nearest even
///                         into the param; states fp32.
///   bf16 param, master_weights(false): updated in fp32 from the bf16 value and
///                         written back rounded to nearest (updates below half
///                         an ulp vanish) or, with stochastic_rounding(true),
///                         rounded up with probability equal to the fraction of
///                         the gap (unbiased), from a counter-based hash of
///                         (seed, step, param position, element index),
///                         or, with kahan_summation(true), with its lost low
///                         bits kept in a compensation buffer of its dtype:
///                         param + compensation carries the fp32 weight to
///                         about 16 bits, 2 bytes a parameter.
/// ```
///
/// The moments (Adam's and LAMB's exp_avg and exp_avg_sq, SGD's momentum)
/// are fp32 or, with state_format, fewer bits (StateFormat), decoded,
/// updated and encoded again in the same fused pass, a tile at a time:
///
/// ```
///   auto opt = ampx::optim::AdamW(params, ampx::optim::AdamWOptions(1e-3)
///                                             .master_weights(false)
///                                             .kahan_summation(true)
///                                             .state_format(ampx::optim::StateFormat::kInt8));
///   // bf16 weight, grad and compensation, two 8-bit moments: about 8 bytes a parameter
/// ```
/// State (masters, moments, step counts) is keyed by (group, index) position,
/// never by tensor identity, and save/load round-trips it bitwise.

#include "ampx/scaler_aware_optimizer.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ampx {
namespace optim {

/// How an optimizer stores its moments. Params of fewer than
/// MixedPrecisionConfig::state_min_numel elements keep fp32 moments in
/// every format (as torchao's and bitsandbytes' 8-bit optimizers do).
enum class StateFormat : int32_t {
  kFp32 = 0,  ///< float32, 4 bytes a moment
  /// bfloat16, rounded stochastically (a second moment rounded to nearest
  /// would never decay: 0.999 v rounds back to v), 2 bytes a moment.
  kBf16 = 1,
  /// FP8 E4M3 codes with an fp32 scale per state_block elements (absmax /
  /// 448; torchao's AdamWFp8), 1 byte a moment.
  kFp8 = 2,
  /// 8-bit codes of bitsandbytes' dynamic tree map (signed first moment,
  /// unsigned second) with an fp32 absmax per state_block elements
  /// (torchao's AdamW8bit), 1 byte a moment.
  kInt8 = 3,
};

/// "fp32", "bf16", "fp8", "8bit".
const char* state_format_name(StateFormat format);
/// The format named `name` (state_format_name's); throws naming it otherwise.
StateFormat state_format_from_name(const std::string& name);

/// An optimizer's state as named tensors and string metadata, the entries
/// and header of a safetensors file (ampx/optim/state_file.h has the layout).
struct OptimizerStateTensors {
  std::map<std::string, at::Tensor> tensors;    ///< the entries, by name
  std::map<std::string, std::string> metadata;  ///< the header's "__metadata__"
};

/// Settings every ampx optimizer takes from the options it was constructed
/// with (per-group copies of them are ignored).
struct MixedPrecisionConfig {
  bool master_weights = true;        ///< fp32 masters for bf16/fp16 params
  bool stochastic_rounding = false;  ///< bf16 params without masters: round stochastically
  uint64_t seed = 0;                 ///< seed of stochastic rounding's hash
  /// Clip the grads' global 2-norm to this; none: no clipping.
  c10::optional<double> max_grad_norm;
  /// bf16/fp16 params without masters: keep the weight's lost low bits in a
  /// compensation buffer of the param's dtype.
  bool kahan_summation = false;
  StateFormat state_format = StateFormat::kFp32;  ///< how the moments are stored
  int64_t state_block = 256;       ///< FP8 / 8-bit: elements per scale (a power of 2, 32..4096)
  int64_t state_min_numel = 4096;  ///< smaller params keep fp32 moments
};

namespace detail {

/// One parameter's optimizer state. Tensors are contiguous, on the param's
/// device; undefined when not used.
struct ParamState {
  at::Tensor master;      // fp32 master of a bf16/fp16 param
  at::Tensor captured;    // fp32 snapshot from capture_master_weights(), until the first step
  at::Tensor exp_avg;     // Adam/LAMB first moment; SGD momentum buffer: fp32, bf16 or uint8 codes
  at::Tensor exp_avg_sq;  // Adam/LAMB second moment, as exp_avg
  at::Tensor exp_avg_scale;     // FP8 / 8-bit moments: fp32, one per block
  at::Tensor exp_avg_sq_scale;  // (flat, ceil(numel / state_block))
  at::Tensor compensation;      // Kahan: the weight's lost low bits, the param's dtype
  int64_t step = 0;       // steps taken (host count; authoritative for CPU params)
  at::Tensor step_t;      // float64 [] on the device (non-CPU params: no host sync)
  /// exp_avg was made for this step: SGD's momentum buffer starts as the
  /// update itself at its first use, as LibTorch's and Python's do, which
  /// need not be the param's first step (momentum switched on later).
  bool exp_avg_fresh = false;
};

/// One param's entries of an optimizer state file, as load_state_tensors
/// reads them (defined in src/optim/optimizer_state_file.cpp).
struct StateFileParam;

/// Which update, and one param group's options, as the fused step's CPU
/// and CUDA kernels read them (defined with them, in src/optim/fused/).
struct FusedOptions;

namespace cuda {
struct MetaCache;
}  // namespace cuda

/// One parameter that has a gradient in this step.
struct ParamWork {
  size_t group = 0;
  size_t index = 0;
  int64_t position = 0;  // index over all groups, in order (RNG key)
  at::Tensor param;
  at::Tensor grad;
  ParamState* state = nullptr;
};

}  // namespace detail

/// The base of ampx's optimizers (the top of this header): a
/// torch::optim::Optimizer whose steps keep fp32 masters and states and that
/// GradScaler hands the scale to (ScalerAwareOptimizer).
class MixedPrecisionOptimizer : public torch::optim::Optimizer, public ScalerAwareOptimizer {
 public:
  /// torch::optim interface: gradients taken as they are (unscaled), no skip.
  torch::Tensor step(LossClosure closure = nullptr) override;

  /// GradScaler's path: grads divided by `grad_scale` (if defined) inside the
  /// update; nothing changes (params, masters, states, step counts) when
  /// `found_inf` != 0. No host synchronisation for non-CPU params.
  void step_scaled(const at::Tensor& grad_scale, const at::Tensor& found_inf) override;

  /// Snapshots an fp32 copy of every param that is float32 now. A param that
  /// is bf16/fp16 at its first step then starts from this copy instead of
  /// from its rounded value; one that is still fp32 drops it.
  void capture_master_weights();

  /// The fp32 master of `param` (an undefined tensor if it has none: fp32
  /// params are their own master; low-precision ones get theirs at their
  /// first step). Throws if `param` is not one of this optimizer's params.
  at::Tensor master(const at::Tensor& param) const;
  /// First moment (Adam/LAMB) or momentum buffer (SGD) of `param` in fp32,
  /// or undefined: the state itself for fp32 moments, a decoded copy for
  /// fewer bits (StateFormat).
  at::Tensor exp_avg(const at::Tensor& param) const;
  /// Second moment (Adam/LAMB) of `param`, as exp_avg().
  at::Tensor exp_avg_sq(const at::Tensor& param) const;
  /// The Kahan compensation of `param` (kahan_summation), or undefined.
  at::Tensor compensation(const at::Tensor& param) const;
  /// The bytes this optimizer keeps for its params (masters, compensations,
  /// moments and their scales; not the params and grads).
  int64_t state_bytes() const;
  /// Steps `param` has taken.
  int64_t step_count(const at::Tensor& param) const;

  /// The optimizer-wide settings, from the options given at construction.
  const MixedPrecisionConfig& config() const { return config_; }

  /// Writes masters, moments, step counts, captured masters, per-group lr and
  /// the seed under position keys ("group0.param3.exp_avg") with a version key.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Reads what save() wrote into an optimizer over params of the same
  /// groups, counts and shapes. Checks everything first: on a mismatch it
  /// throws naming it and changes nothing.
  void load(torch::serialize::InputArchive& archive) override;

  /// The state as named tensors and metadata: what
  /// save_optimizer_safetensors() (ampx/optim/state_file.h) writes, for
  /// params named `names` (one per param, in group order).
  OptimizerStateTensors state_tensors(const std::vector<std::string>& names) const;
  /// Reads state_tensors()' layout, from ampx or from torchao's low-bit
  /// optimizers (tools/optim_state_torchao.py): checks everything first
  /// (throwing, naming the entry, it changes nothing), then commits.
  void load_state_tensors(const OptimizerStateTensors& state,
                          const std::vector<std::string>& names);

  /// "AdamW", "SGD", "LAMB".
  virtual const char* name() const = 0;

  /// For params that are pieces of sharded parameters: given this step's
  /// params and an [n, 2] float64 CPU tensor of sums over each (its
  /// weight's and its update's squares), returns the [n, 2] sums over every
  /// rank's pieces of the same parameters. Collective.
  using PieceSums =
      std::function<at::Tensor(const std::vector<at::Tensor>& params, const at::Tensor& sums)>;
  /// Makes the per-parameter norms an update reads (LAMB's trust ratio
  /// ||w|| / ||u||) those of the whole parameters this optimizer's params
  /// are pieces of, through `sums`: FullyShardedDataParallel::piece_sums().
  /// An optimizer that reads such norms then calls it once in every step
  /// it takes (a step skipped for inf/NaN gradients calls it on no rank,
  /// as GradScaler's agreed found-inf skips them all), also on a rank with
  /// no gradient to step. Dense CPU params only; refused with
  /// max_grad_norm, a norm over all parameters (clip with
  /// FullyShardedDataParallel::clip_grad_norm_). Empty: params are whole.
  void set_piece_sums(PieceSums sums);

 protected:
  /// For subclasses: `defaults` are their options, `config` the
  /// optimizer-wide settings taken from them.
  MixedPrecisionOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                          std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                          MixedPrecisionConfig config);

  /// Whether this optimizer keeps exp_avg for a param of `group`.
  virtual bool uses_exp_avg(const torch::optim::OptimizerOptions& group) const = 0;
  /// Whether this optimizer keeps exp_avg_sq.
  virtual bool uses_exp_avg_sq() const = 0;
  /// Whether its update reads each param's norms (LAMB).
  virtual bool reads_param_norms() const { return false; }
  /// ATen-op update for any device: `grad` is fp32, already multiplied;
  /// state.step_t already counts this step; `skip` (bool [], on the param's
  /// device) or undefined: where true every write must keep the old value.
  virtual void update_generic(detail::ParamWork& work, const at::Tensor& grad,
                              const at::Tensor& skip) = 0;

  /// The update and options of param group `group` for the fused step (the
  /// same on the CPU and on CUDA).
  virtual detail::FusedOptions fused_options(size_t group) const = 0;

  /// dst := skip ? dst : value (dst's dtype).
  static void commit(at::Tensor& dst, const at::Tensor& value, const at::Tensor& skip);
  /// Writes the new fp32 weight to the master (if any) and the param.
  void write_weight(detail::ParamWork& work, const at::Tensor& new_weight,
                    const at::Tensor& skip) const;
  /// The fp32 weight this step reads (the master, the fp32 param, or a widened copy).
  static at::Tensor weight_f32(const detail::ParamWork& work);

 private:
  void run_step(const at::Tensor& grad_scale, const at::Tensor& found_inf);
  void sync_state_shape();
  void prepare(detail::ParamWork& work) const;
  /// Whether `param`'s moments are coded (state_format, state_min_numel).
  bool coded_moments(const at::Tensor& param) const;
  /// Whether `param` keeps a Kahan compensation.
  bool kahan(const at::Tensor& param) const;
  /// Throws, naming the setting and the param, if `work`'s param needs the
  /// fused steps' tiles (coded moments, Kahan) and neither the CPU's step nor
  /// (where `cuda_tiles`) the CUDA step's can take it.
  void check_untiled(const detail::ParamWork& work, bool cuda_tiles) const;
  /// Whether the moments' format has block scales (FP8, 8-bit).
  bool block_scaled() const {
    return config_.state_format == StateFormat::kFp8 || config_.state_format == StateFormat::kInt8;
  }
  /// Throws, naming both, unless the state format, block and Kahan setting
  /// `archive` was saved with (version 1: fp32, no Kahan) are this optimizer's.
  void check_saved_format(torch::serialize::InputArchive& archive, int64_t version,
                          const char* who) const;
  /// Throws unless `t`, read as slot `k` of optimizer_state.cpp's keys for
  /// `param`, has the dtype and shape this optimizer keeps there.
  void check_slot(const at::Tensor& t, int k, const at::Tensor& param, const std::string& key,
                  const char* who) const;
  /// A new zero moment of `param` in its format, and its block scales if any.
  void make_moment(const at::Tensor& param, bool is_signed, at::Tensor& moment,
                   at::Tensor& scale) const;
  /// Dense CUDA params (and grads) that the fused CUDA step takes.
  static bool cuda_fusable(const detail::ParamWork& work);
  /// The fused step of dense CPU params (step counts already incremented).
  void update_cpu(const std::vector<detail::ParamWork>& work, float grad_mul);
  void update_cuda(const std::vector<detail::ParamWork>& work, const at::Tensor& grad_mul,
                   const at::Tensor& found_inf);
  const detail::ParamState* find_state(const at::Tensor& param) const;
  /// One param's state from its entries of a state file (load_state_tensors);
  /// throws naming what it refuses.
  detail::ParamState read_state_entries(const detail::StateFileParam& file) const;
  /// Moment `m` (0: exp_avg, 1: exp_avg_sq) of those entries into `st`.
  void read_moment_entry(const detail::StateFileParam& file, int m, detail::ParamState& st) const;

  MixedPrecisionConfig config_;
  PieceSums piece_sums_;                                 // set_piece_sums()
  std::vector<std::vector<detail::ParamState>> states_;  // [group][index]
  std::shared_ptr<detail::cuda::MetaCache> cuda_cache_;  // the fused CUDA step's operands
};

/// A moment as an optimizer keeps it: coded_moment()'s result.
struct CodedMoment {
  at::Tensor values;  ///< float32, bfloat16 or uint8 codes
  at::Tensor scale;   ///< float32 [ceil(numel / state_block)], or undefined
};
/// A moment as an optimizer of `config` keeps it for a param of
/// values.numel() elements: `values` (float32, the param's shape) itself
/// where it keeps fp32 moments (StateFormat::kFp32, or fewer than
/// state_min_numel elements), otherwise encoded in state_format with a new
/// scale per block of state_block elements (bf16: rounded stochastically
/// under `key`) and its scales in `scale`; `first_moment` picks the signed
/// 8-bit map. What a sharded checkpoint loaded on another number of ranks,
/// whose pieces were saved as fp32 values, is made into. CPU tensors.
CodedMoment coded_moment(const MixedPrecisionConfig& config, const at::Tensor& values,
                         bool first_moment, uint64_t key);

/// The model's params, in group order (low-precision under O2): the tensors
/// whose .grad() the next step reads, i.e. what to clip. ampx keeps no fp32
/// copy of the gradients (the fused kernels widen bf16/fp16 grads on the
/// fly), so clipping these, e.g. with torch::nn::utils::clip_grad_norm_ after
/// GradScaler::unscale_, clips exactly what the update consumes. For a norm computed in fp32 from
/// the low-precision grads in the same pass, use the max_grad_norm option.
std::vector<at::Tensor> model_params(const MixedPrecisionOptimizer& optimizer);

/// The fp32 weights the optimizer updates, one per param in group order: the
/// master of a low-precision param, the param itself when it is fp32 (or has
/// no master yet / master_weights(false): then the param, in its dtype).
std::vector<at::Tensor> master_weights(const MixedPrecisionOptimizer& optimizer);

}  // namespace optim
}  // namespace ampx
