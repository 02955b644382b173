#pragma once

// --shard full, grad and optimizer's checkpoints: rank 0's checkpoint file
// (the run's description and progress, the loss scalers, the CPU generator;
// no weights) names one shard file per rank beside it, each written by its
// rank: that rank's fp32 masters and AdamW state by parameter name and
// element (ampx::dist::FullyShardedDataParallel::save_shard, or
// ZeroRedundancyOptimizer::save_shard: one format), in the checkpoint
// file's framing (CRC-32, atomic). Any number of ranks resumes them, under
// any of the three shardings (every rank reads every shard file: the folder
// must be shared).
//
//   checkpoint.ampx                          "shards": {"world_size": 2, "files": [...]}
//   checkpoint-step100-rank0-of2.ampx        rank 0's shard at step 100
//   checkpoint-step100-rank1-of2.ampx
//
// A save writes the new shard files under the step's names, then the
// checkpoint file, then removes the shard files of earlier steps: a crash at
// any point leaves a checkpoint whose files are all there.

#include "run/checkpoint.h"

#include <ampx/dist.h>
#include <ampx/fsdp.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

namespace ampx::train {

/// What a rank saves into its shard file and loads from every saved rank's:
/// the sharded wrapper's or ZeRO-1's pieces and the optimizer's state.
struct ShardIo {
  std::function<void(torch::serialize::OutputArchive&)> save;
  std::function<void(int64_t saved_world_size,
                     const ampx::dist::FullyShardedDataParallel::ShardReader&)>
      load;
};

/// Every rank's shard file, then rank 0's checkpoint at `path` (see the top
/// of this header); an error on any rank throws on every rank and leaves the
/// previous checkpoint as it was. Collective.
void save_sharded_checkpoint(const std::filesystem::path& path, const nlohmann::json& identity,
                             int64_t steps_per_epoch, const ShardIo& shards, ampx::AmpSession& amp,
                             const RunState& state, const ampx::dist::ProcessGroup& group);

/// Restores a sharded checkpoint whose file at `path` holds `bytes` (read by
/// rank 0): its shard files (checked: framing, CRC, run, step, rank) through
/// `shards` on any number of ranks, then the loss scalers and
/// the CPU generator. A missing, damaged or mismatched shard file is named
/// with its rank, on every rank, and nothing is restored. Collective.
RunState load_sharded_checkpoint(const std::filesystem::path& path, const std::string& bytes,
                                 const nlohmann::json& identity, const ShardIo& shards,
                                 ampx::AmpSession& amp, const ampx::dist::ProcessGroup& group);

/// Reads rank `rank` of `world`'s shard file at step `step` into `archive`:
/// its framing and CRC (read_checkpoint), that it is a shard file of that
/// rank, world size and step written by a run compatible with `identity`,
/// then its payload's archive (checked before LibTorch reads it). Errors
/// name the file and what differs.
void read_shard_file(const std::filesystem::path& file, int64_t rank, int64_t world, int64_t step,
                     const nlohmann::json& identity, torch::serialize::InputArchive& archive);

/// The name of rank `rank` of `world`'s shard file at step `step` beside
/// the checkpoint `path`: "checkpoint-step100-rank0-of2.ampx".
std::string shard_file_name(const std::filesystem::path& path, int64_t step, int64_t rank,
                            int64_t world);

}  // namespace ampx::train
