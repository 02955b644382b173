#pragma once

/// \file
/// Activation checkpointing: Python's `torch.utils.checkpoint.checkpoint`
/// (use_reentrant=True) for LibTorch's C++ API, which has none. A function
/// run through checkpoint() keeps none of its activations for backward: it
/// runs without a graph, keeps its inputs, and runs again in backward to
/// make the graph its gradients need. Memory for compute.
///
/// ```
///   // in a model's forward: one transformer block's activations at a time
///   for (auto& block : blocks) {
///     x = ampx::checkpoint([&](const torch::Tensor& h) { return block->forward(h); }, x);
///   }
///   // in the training step, as ever
///   {
///     auto forward = amp.forward_guard();               // O1 autocast, O2 fp32 norms
///     loss = loss_fn(model->forward(amp.cast_input(x)), y);
///   }
///   amp.scaler().scale(loss).backward();                 // blocks run again here
/// ```
///
/// The recompute runs in the regions the forward ran in, as Python's does:
/// the thread's autocast state (AutocastGuard: enabled, dtype and cache, per
/// device, with its wide products on the CPU), the innermost
/// AmpSession::forward_guard() (O1's autocast, O2's fp32 norms, O2's and
/// O3's wide products), and the random number generators: the CPU's default
/// generator, and CUDA's on each device of a CUDA input, are set to their
/// state at the forward for the recompute and put back after it (so dropout
/// drops the same elements; preserve_rng_state(false) skips this). Other
/// process-wide guards made around the forward alone (CastPolicyGuard,
/// KeepNormsFp32Guard, Fp32RegionGuard made by hand) are not alive in
/// backward: keep them over backward too, or make them again in
/// CheckpointOptions::recompute_region.
///
/// Semantics (those of PyTorch's reentrant checkpoint):
/// - Gradients reach `fn`'s parameters through a backward run inside
///   backward: they are accumulated into their .grad when the checkpoint's
///   node runs, hooks on them fire then, and `torch::autograd::grad` cannot
///   differentiate through a checkpoint (use backward()).
/// - The outputs require grad only if some input does: with no input that
///   requires grad, `fn`'s parameters get no gradient (a warning says so, as
///   Python's does).
/// - `fn` must compute the same thing twice: no data-dependent side effects,
///   no in-place change of an input. An input changed in place between
///   forward and backward is refused by the version check.
/// - Under torch::NoGradGuard, `fn` simply runs (nothing to keep).
/// - Refused inside an FP8 region (ampx::fp8::Fp8AutocastGuard): the
///   recompute would record each FP8 layer's amax a second time.
///
/// Nested checkpoints work (the inner one runs again when the outer one
/// recomputes). ampx::dist::FullyShardedDataParallel's units cannot be
/// checkpointed (ampx/fsdp.h).

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <functional>
#include <memory>
#include <vector>

namespace ampx {

/// Options of checkpoint().
struct CheckpointOptions {
  /// Whether the recompute draws the random numbers the forward drew (the
  /// CPU generator's state, and CUDA's for CUDA inputs, saved at the forward
  /// and set for the recompute). Python's preserve_rng_state.
  TORCH_ARG(bool, preserve_rng_state) = true;
  /// Called just before the recompute, inside the recorded autocast and
  /// forward regions; what it returns lives until the recompute ends. For
  /// process-wide guards the forward ran inside (Python's context_fn):
  ///   .recompute_region([] { return std::make_shared<ampx::Fp32RegionGuard>(torch::kCPU); })
  TORCH_ARG(std::function<std::shared_ptr<void>()>, recompute_region);
};

/// The function checkpoint() runs: tensors in, tensors out.
using CheckpointFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// fn(inputs) without keeping its activations; backward runs it again. The
/// outputs are fn's (one that is an input comes back as a view of it).
/// Errors: an empty fn, an undefined input or output, and a call inside an
/// FP8 region.
std::vector<at::Tensor> checkpoint(const CheckpointFunction& fn,
                                   const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options = {});

/// The one-tensor form: fn(input).
at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input, const CheckpointOptions& options = {});

}  // namespace ampx
