#pragma once

/// \file
/// The region that turns FP8 on, after Transformer Engine's fp8_autocast, and
/// the amax reduction across data-parallel ranks that ends it:
///
/// ```
///   ampx::fp8::Fp8AutocastOptions region;
///   region.amax_reduction_group(&pg);            // TE's fp8_group (optional)
///   {
///     ampx::fp8::Fp8AutocastGuard fp8(region);   // TE's fp8_autocast(enabled=True)
///     auto y = fc->forward(x);                   // an FP8 product
///     fp8.finish();                              // TE's exit: one all-reduce of the amaxes
///   }
///   ampx::fp8::is_fp8_enabled();                 // false again
/// ```
///
/// Ending a region is two things: this thread's FP8 state goes back to what it
/// was (local, cannot fail), and, with an amax_reduction_group, the forward
/// amaxes of the region are max-reduced over the group's ranks (a collective:
/// every rank must get there, and it can throw). The first is the
/// destructor's; the second is finish()'s, an explicit call, so that a
/// collective and its errors happen where the code says so rather than in a
/// destructor (which would turn a failed all-reduce inside a container, an
/// std::optional or a unique_ptr into std::terminate). A region without a
/// group has nothing to reduce: finish() is optional there.
///
/// A region with a group that ends without finish() (an exception, or a
/// forgotten call) records none of its forward amaxes: no rank updates its
/// delayed-scaling histories from that region, so the ranks stay the same
/// (as they do when an exception leaves the region on every rank). Outside
/// an exception it warns once.

#include <torch/arg.h>

#include <memory>

namespace ampx {
namespace dist {
class ProcessGroup;
}  // namespace dist

namespace fp8 {

/// When an FP8 layer under delayed or current scaling casts its weight: with
/// gradient accumulation, once per optimizer step rather than once per
/// micro-batch (TE's is_first_microbatch; docs/fp8.md, "The weight's cast").
/// The caller says where a step begins: a weight's version counter cannot,
/// since LibTorch's SGD writes parameters through `.data()`, a tensor with a
/// version counter of its own (its Adam, AdamW, RMSprop and Adagrad count
/// their writes, as ampx's optimizers do).
enum class WeightCasts {
  /// Every forward casts the weight; nothing is kept (TE's is_first_microbatch
  /// None, and torchao's only way).
  kEveryForward,
  /// The region's forwards begin a step: each layer casts its weight and keeps
  /// the codes (one byte per weight element; two on CUDA, with the
  /// transpose's) until its next cast (is_first_microbatch True). Under
  /// c10::InferenceMode nothing is kept or given again.
  kFirstMicroBatch,
  /// The step's later micro-batches: each layer gives again the codes it kept
  /// (is_first_microbatch False), and records the weight's amax as a cast
  /// would. Under current scaling that is exactly what casting again gives;
  /// under delayed scaling, the codes of the scale the step's first
  /// micro-batch had. A layer that kept nothing, or whose weight has since
  /// been replaced or changed in place (by ampx's optimizers, an in-place op,
  /// a load: anything that counts on the weight's version counter, or moved
  /// by set_data), casts and keeps anew.
  kLaterMicroBatch,
};

/// What a region carries besides being on.
struct Fp8AutocastOptions {
  /// A process group the caller owns (the region only points to it).
  using GroupPtr = const dist::ProcessGroup*;
  /// False: a region with FP8 off (inside an enabled one, say).
  TORCH_ARG(bool, enabled) = true;
  /// TE's reduce_amax over fp8_group: every FP8 cast's amax is max-reduced
  /// over this group's ranks before it updates a delayed-scaling history, so
  /// the states (and the next casts) are the same on every rank. Forward
  /// amaxes are reduced in one all-reduce when the region's finish() runs,
  /// output-gradient amaxes in one when the backward that produced them ends.
  /// Null: each rank keeps its own. The group must outlive the region and the
  /// backward. Not for current scaling (each tensor scales itself).
  TORCH_ARG(GroupPtr, amax_reduction_group) = nullptr;
  /// When the region's FP8 layers cast their weights: kFirstMicroBatch for
  /// the region of a step's first micro-batch and kLaterMicroBatch for the
  /// others cast each weight once per optimizer step.
  TORCH_ARG(WeightCasts, weight_casts) = WeightCasts::kEveryForward;
};

/// Turns FP8 on for ampx::fp8::Linear layers and converted torch::nn::Linear
/// layers run on this thread (and by autograd for them) while alive; nests,
/// and restores the previous state. TE's fp8_autocast(enabled, fp8_group);
/// the recipe belongs to each layer (see docs/fp8.md).
class Fp8AutocastGuard {
 public:
  /// A region with FP8 on (or off) and no amax reduction group.
  explicit Fp8AutocastGuard(bool enabled = true);
  /// A region as `options` say.
  explicit Fp8AutocastGuard(const Fp8AutocastOptions& options);
  /// Restores this thread's FP8 state if finish() has not; never reduces,
  /// never throws (see the top of this header).
  ~Fp8AutocastGuard();
  Fp8AutocastGuard(const Fp8AutocastGuard&) = delete;
  Fp8AutocastGuard& operator=(const Fp8AutocastGuard&) = delete;

  /// Ends the region: restores this thread's FP8 state, then, with an
  /// amax_reduction_group, max-reduces the region's forward amaxes over the
  /// group in one all-reduce and records them (throws what the group throws).
  /// Call it on the innermost region of this thread; a second call does
  /// nothing. After it, FP8 is off (or as the enclosing region says).
  void finish();

 private:
  struct Region;
  std::unique_ptr<Region> region_;
};

/// Whether an Fp8AutocastGuard is enabled on this thread.
bool is_fp8_enabled();

}  // namespace fp8
}  // namespace ampx
