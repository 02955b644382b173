#pragma once

// --shard: what each rank of a data-parallel run keeps of the model.
//
//   none       DistributedDataParallel: every rank the whole model, its
//              gradients, masters and AdamW state
//   optimizer  ZeRO-1 (ampx/zero.h): the whole model and its gradients, a
//              1/N share of the fp32 masters and AdamW state
//   grad       ZeRO-2 (ampx/fsdp.h, parameters kept gathered from forward
//              to backward): a 1/N share of masters, gradients and state
//   full       ZeRO-3 (ampx/fsdp.h): the same, each unit (a gpt block, the
//              rest of the model) gathered only while it computes

#include "cli/config.h"
#include "run/run_result.h"
#include "run/workloads.h"
#include "shard_checkpoint.h"

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <ampx/optim/adamw.h>

#include <nlohmann/json.hpp>

#include <map>
#include <string>

namespace CLI {
class App;
}  // namespace CLI

namespace ampx::train {

struct ModeSetUp;

/// Adds --shard to `app`, into config.shard.
void add_shard_option(CLI::App& app, TrainConfig& config);

/// Refuses --shard where this run cannot shard (one process; a mode
/// check_shard_mode() refuses): c10::Error naming the flags.
void check_shard_config(const TrainConfig& config);

/// Refuses mode `mode` under --shard (O3, which keeps no masters; the FP8
/// modes and auto, whose weights are not gathered in 8 bits yet).
void check_shard_mode(const TrainConfig& config, const Mode& mode);

/// What each rank holds, for the settings table ("" for --shard none).
std::string shard_description(const TrainConfig& config);

/// --shard's set-up of `setup` (its model built in fp32 and seeded; the
/// mode passed check_shard_mode()): the
/// FullyShardedDataParallel over the workload's units and the root (grad,
/// full) or ZeRO-1 (optimizer), AdamW over what this rank steps, the AMP
/// session on it, and found-inf agreed across `group`.
void set_up_sharded(const TrainConfig& config, Workload& workload, const Mode& mode,
                    const ampx::dist::ProcessGroup& group, const ampx::optim::AdamWOptions& options,
                    const ampx::AmpOptions& amp_options, ModeSetUp& setup);

/// What a --shard run's checkpoints save and load on each rank (the
/// wrapper's pieces, or ZeRO-1's, and the optimizer's state); empty
/// functions for --shard none.
ShardIo shard_io(const TrainConfig& config, ModeSetUp& setup);

/// Every rank's peak_bytes of `result` in rank_peak_bytes, and the largest
/// of them as peak_bytes: what must fit on each rank. Collective.
void gather_rank_peaks(const ampx::dist::ProcessGroup& group, RunResult& result);

/// The end of a --shard full or grad run: rank 0 gathers the fp32 weights
/// unit by unit; every rank's weights_checksum is theirs, and rank 0
/// writes them to --export-weights (with `identity` as metadata). Collective.
void finish_fully_sharded(const TrainConfig& config, const std::string& mode,
                          const nlohmann::json& identity, const ampx::dist::ProcessGroup& group,
                          ModeSetUp& setup, RunResult& result);

}  // namespace ampx::train
