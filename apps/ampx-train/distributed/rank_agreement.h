#pragma once

// The ranks of a run must train the same thing: a rank started with another
// model shape, precision or batch fails at start-up, on every rank alike,
// naming what differs, instead of hanging or failing in a collective whose
// tensors do not match.
//
//   check_ranks_agree(group, run_fingerprint(identity, model, steps));
//   // ampx-train: the ranks of this run were started with different settings
//   // (...): precision: O2 on rank(s) 0, 2 vs O1 on rank(s) 1; ...
//
// and what the ranks share: rank 0's reading of a file, and a checksum of
// the weights to compare at the end.
//
//   std::string bytes = from_rank0(group, [&] { return read_checkpoint_bytes(path); });
//   weights_checksum(model);  // "0x1f3a...", equal on ranks with the same bits

#include <ampx/dist.h>

#include <torch/nn/module.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace ampx::train {

/// What must be equal on every rank: `identity` (workload, model shape,
/// precision, dtype, batch, seed, device), the steps, and the model's
/// parameters (count, values, dtypes) as built and cast.
nlohmann::json run_fingerprint(const nlohmann::json& identity, const torch::nn::Module& model,
                               int64_t steps);

/// Each differing field of `by_rank` (rank r's fingerprint at r) with the
/// ranks holding each value: "precision: O2 on rank(s) 0, 2 vs O1 on rank(s) 1".
/// Empty when every rank agrees.
std::string disagreement(const std::vector<nlohmann::json>& by_rank);

/// Sends `fingerprint` to every rank of `group` (two all-gathers) and throws,
/// on every rank alike, when any rank's differs.
void check_ranks_agree(const ampx::dist::ProcessGroup& group, const nlohmann::json& fingerprint);

/// What `fn` returns on rank 0, on every rank of `group` (rank 0 alone reads
/// files: the other hosts need not have them); `fn` itself without a group.
/// When `fn` throws there, every rank throws, the others with rank 0's message.
std::string from_rank0(const ampx::dist::ProcessGroup* group,
                       const std::function<std::string()>& fn);

/// FNV-1a (64-bit) over the FNV-1a of each parameter's bytes, in order,
/// "0x...": equal on ranks whose weights are bitwise equal.
std::string weights_checksum(torch::nn::Module& model);
/// The same over `tensors`, in order.
std::string weights_checksum(const std::vector<torch::Tensor>& tensors);
/// The same from each tensor's tensor_hash(), in order (a sharded model's
/// parameters, hashed as they are gathered a unit at a time).
std::string weights_checksum(const std::vector<uint64_t>& hashes);
/// FNV-1a (64-bit) of `t`'s bytes.
uint64_t tensor_hash(const torch::Tensor& t);

}  // namespace ampx::train
