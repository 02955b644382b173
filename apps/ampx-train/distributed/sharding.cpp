#include "sharding.h"

#include "rank_agreement.h"
#include "reports/weights_export.h"
#include "run/trainer.h"

#include <ampx/fsdp.h>
#include <ampx/zero.h>

#include <CLI/CLI.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <memory>
#include <sstream>
#include <vector>

namespace ampx::train {

void add_shard_option(CLI::App& app, TrainConfig& c) {
  app.add_option("--shard", c.shard,
                 "what each data-parallel rank keeps: none (the whole model, as DDP), optimizer "
                 "(ZeRO-1: 1/N of the fp32 masters and AdamW state), grad (ZeRO-2: 1/N of "
                 "masters, gradients and state), full (ZeRO-3: the same, each gpt block "
                 "gathered only while it computes)")
      ->check(CLI::IsMember({"none", "optimizer", "grad", "full"}))
      ->capture_default_str();
}

void check_shard_config(const TrainConfig& c) {
  if (c.shard == "none") return;
  TORCH_CHECK(c.nproc > 1 || ampx::dist::launched_as_rank(), "ampx-train: --shard ", c.shard,
              " shares the model's state among data-parallel processes; give --nproc N (N > 1) "
              "or start the ranks with a launcher (torchrun)");
  for (const auto& mode : modes_of(c)) check_shard_mode(c, parse_mode(mode, c));
}

void check_shard_mode(const TrainConfig& c, const Mode& mode) {
  if (c.shard == "none") return;
  TORCH_CHECK(mode.level != ampx::OptLevel::O3, "ampx-train: --shard ", c.shard,
              " keeps the fp32 master weights in the ranks' shards, but --precision O3 trains "
              "without masters; use O2 (its weights in ",
              mode.dtype_name(), ", masters fp32)");
  // FP8 Linears: ZeRO-1 keeps the model whole; ZeRO-2 and -3 gather their
  // weights as codes (and block-scaled ones' scales).
  TORCH_CHECK(mode.name != "auto", "ampx-train: --shard ", c.shard,
              " with --precision auto: a plan's layers are not gathered in their own formats "
              "yet; shard fp32, O1, O2, fp8, mxfp8, nvfp4 or fp8-block");
}

std::string shard_description(const TrainConfig& c) {
  if (c.shard == "none") return "";
  std::ostringstream s;
  if (c.shard == "optimizer") {
    s << "optimizer (ZeRO-1): each rank the whole model and its gradients, 1/" << c.nproc
      << " of the fp32 masters and AdamW state";
  } else {
    s << c.shard << (c.shard == "full" ? " (ZeRO-3)" : " (ZeRO-2)") << ": each rank 1/" << c.nproc
      << " of the fp32 masters, gradients and AdamW state; gathered in the mode's dtype "
      << (c.shard == "full" ? "one unit (a block, the rest) at a time"
                            : "from forward to backward");
    for (const auto& mode : modes_of(c)) {
      if (mode == "fp8") s << "; fp8: the FP8 Linears' weights as their E4M3 codes";
      if (mode == "mxfp8" || mode == "nvfp4" || mode == "fp8-block") {
        s << "; " << mode
          << ": the Linears' weights as their codes and block scales (unless mostly padding)";
      }
    }
  }
  return s.str();
}

void set_up_sharded(const TrainConfig& config, Workload& workload, const Mode& mode,
                    const ampx::dist::ProcessGroup& group, const ampx::optim::AdamWOptions& options,
                    const ampx::AmpOptions& amp_options, ModeSetUp& setup) {
  if (config.shard == "optimizer") {
    // The model stays whole; ZeRO-1 snapshots its fp32 values before O2's cast.
    auto zero = std::make_unique<ampx::dist::ZeroRedundancyOptimizer>(
        setup.model->parameters(), group, [options](std::vector<torch::Tensor> shard) {
          return std::make_unique<ampx::optim::AdamW>(std::move(shard), options);
        });
    setup.amp = std::make_unique<ampx::AmpSession>(ampx::initialize(setup.model, {}, amp_options));
    // Its shards cut now, after the cast, rather than at the first step: the
    // fp32 snapshot (4 bytes a parameter) is gone before the first forward.
    zero->master_shards();
    setup.optimizer = std::move(zero);
  } else {
    auto fsdp_options =
        ampx::dist::FullyShardedDataParallelOptions()
            .param_dtype(mode.level == ampx::OptLevel::O2 ? mode.dtype : c10::kFloat)
            .reshard_after_forward(config.shard == "full")
            .fp8_all_gather(mode.fp8);  // the Linears set_up_mode converted before
    setup.fsdp = std::make_unique<ampx::dist::FullyShardedDataParallel>(
        setup.model, group, workload.units(*setup.model), fsdp_options);
    setup.optimizer = std::make_unique<ampx::optim::AdamW>(setup.fsdp->parameters(), options);
    setup.amp = std::make_unique<ampx::AmpSession>(ampx::initialize(*setup.fsdp, amp_options));
  }
  // Each rank checks its own share of the gradients: every rank skips together.
  ampx::dist::synchronize_found_inf(setup.amp->scaler(), group);
}

ShardIo shard_io(const TrainConfig& config, ModeSetUp& setup) {
  if (setup.fsdp) {
    auto* fsdp = setup.fsdp.get();
    auto* optimizer = setup.optimizer.get();
    return {
        [fsdp, optimizer](torch::serialize::OutputArchive& a) { fsdp->save_shard(a, optimizer); },
        [fsdp, optimizer](int64_t world,
                          const ampx::dist::FullyShardedDataParallel::ShardReader& read) {
          fsdp->load_shards(world, read, optimizer);
        }};
  }
  if (config.shard != "optimizer") return {};
  auto* zero = dynamic_cast<ampx::dist::ZeroRedundancyOptimizer*>(setup.optimizer.get());
  TORCH_CHECK(zero != nullptr, "ampx-train: --shard optimizer without its ZeRO-1 optimizer");
  auto model = setup.model;
  return {
      [zero, model](torch::serialize::OutputArchive& a) { zero->save_shard(a, *model); },
      [zero, model](int64_t world, const ampx::dist::FullyShardedDataParallel::ShardReader& read) {
        zero->load_shards(world, read, *model);
      }};
}

void gather_rank_peaks(const ampx::dist::ProcessGroup& group, RunResult& result) {
  result.rank_peak_bytes.clear();
  for (const auto& text : group.all_gather_bytes(std::to_string(result.peak_bytes))) {
    result.rank_peak_bytes.push_back(std::stoll(text));  // text: any backend carries it
  }
  result.peak_bytes =
      *std::max_element(result.rank_peak_bytes.begin(), result.rank_peak_bytes.end());
}

void finish_fully_sharded(const TrainConfig& config, const std::string& mode,
                          const nlohmann::json& identity, const ampx::dist::ProcessGroup& group,
                          ModeSetUp& setup, RunResult& result) {
  // Rank 0 hashes each parameter as its unit is gathered, and the export
  // streams unit by unit: no rank ever holds the whole fp32 model.
  std::map<std::string, uint64_t> hashes;
  setup.fsdp->for_each_full_parameter([&](const std::string& name, const torch::Tensor& value) {
    hashes[name] = tensor_hash(value);
  });
  result.weights_checksum = from_rank0(&group, [&] {
    std::vector<uint64_t> ordered;
    for (const auto& p : setup.model->named_parameters()) ordered.push_back(hashes.at(p.key()));
    return weights_checksum(ordered);
  });
  if (config.export_weights.empty()) return;
  result.weights_path = export_path_for(config, mode);
  export_weights(result.weights_path, *setup.fsdp, identity, group.rank() == 0);
}

}  // namespace ampx::train
