#pragma once

// What the data-parallel wrappers (DistributedDataParallel,
// FullyShardedDataParallel, ZeroRedundancyOptimizer) share: the ranks'
// models compared and rank 0's broadcast at construction, and the global
// norm of sharded gradients.

#include "ampx/dist.h"

#include <ATen/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace ampx {
namespace detail {

/// Each parameter and buffer of `module`, in module order: "parameter 'name'"
/// -> "Float [4, 16] on cpu" (", frozen" when it needs no gradient).
std::vector<std::pair<std::string, std::string>> describe_module(const torch::nn::Module& module);

/// Throws, on every rank alike, when the ranks' `mine` differ (PyTorch's DDP
/// checks parameter shapes at construction too): a model built differently
/// on one rank would otherwise fail inside Gloo, hang, or train on
/// mismatched gradients. The message starts with `who` and names each
/// difference with the ranks holding each value. Collective.
void check_same_on_every_rank(const std::vector<std::pair<std::string, std::string>>& mine,
                              const dist::ProcessGroup& group, const std::string& who);

/// Copies rank 0's parameters and buffers of `module` into every rank's, in
/// place (16-bit ones as their bytes). Collective.
void broadcast_from_rank_zero(torch::nn::Module& module, const dist::ProcessGroup& group);

/// Scales `grads`, this rank's shards of a model's gradients (each element
/// on one rank), so that their L2 norm over every rank, times `unscale`, is
/// at most `max_norm` (torch::nn::utils::clip_grad_norm_'s coefficient
/// max / (norm + 1e-6), at most 1). One scalar all-reduce; returns that
/// norm, the same on every rank.
double clip_sharded_grad_norm(const std::vector<at::Tensor>& grads, const dist::ProcessGroup& group,
                              double max_norm, double unscale = 1.0);

}  // namespace detail
}  // namespace ampx
