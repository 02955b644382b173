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

#include "config.h"
#include "workloads.h"

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <ampx/optim/adamw.h>

#include <string>

namespace ampx::train {

struct ModeSetUp;

/// Refuses --shard where this run cannot shard (one process; checkpoints
/// and --export-weights that are not written sharded yet): c10::Error naming
/// the flags.
void check_shard_config(const TrainConfig& config);

/// Refuses mode `mode` under --shard (O3, which keeps no masters; the FP8
/// modes and auto, whose weights are not gathered in 8 bits yet).
void check_shard_mode(const TrainConfig& config, const Mode& mode);

/// What each rank holds, for the settings table ("" for --shard none).
std::string shard_description(const TrainConfig& config);

/// --shard's set-up of `setup` (its model built in fp32 and seeded): the
/// FullyShardedDataParallel over the workload's units and the root (grad,
/// full) or ZeRO-1 (optimizer), AdamW over what this rank steps, the AMP
/// session on it, and found-inf agreed across `group`.
void set_up_sharded(const TrainConfig& config, Workload& workload, const Mode& mode,
                    const ampx::dist::ProcessGroup& group, const ampx::optim::AdamWOptions& options,
                    const ampx::AmpOptions& amp_options, ModeSetUp& setup);

}  // namespace ampx::train
