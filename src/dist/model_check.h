#pragma once

// What every rank's wrapper of a model (DistributedDataParallel,
// FullyShardedDataParallel) compares at construction, and the comparison.

#include "ampx/dist.h"

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

}  // namespace detail
}  // namespace ampx
