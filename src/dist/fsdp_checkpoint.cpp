// FullyShardedDataParallel's checkpoints: each rank saves its pieces of the
// parameters by name and element range (the format of shard_pieces.h, which
// ZeroRedundancyOptimizer's shards share), so that any number of ranks can
// load them (resharding). load_shards() writes the optimizer's part for
// ampx::optim's own load() (src/optim/optimizer_state.cpp's position keys),
// which checks it again.

#include "ampx/fsdp.h"

#include "ampx/optim/optimizer.h"
#include "fsdp_impl.h"
#include "process_group_impl.h"
#include "shard_pieces.h"

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/torch.h>

#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ampx {
namespace dist {

#if defined(AMPX_WITH_DIST)

namespace {

/// The element of `p` where this rank's piece starts.
int64_t piece_begin(const fsdp::Impl& impl, const fsdp::Param& p) {
  const auto& space = impl.units[static_cast<size_t>(p.unit)].spaces[static_cast<size_t>(p.space)];
  return impl.group.rank() * space.master.numel() + p.piece_offset - p.offset;
}

/// This rank's layout as a shard records it (shard::write_shard): the
/// piece of a parameter each of the optimizer's params is.
std::string layout_of(const fsdp::Impl& impl, const ampx::optim::MixedPrecisionOptimizer& opt) {
  std::unordered_map<const c10::TensorImpl*, const fsdp::Param*> param_of;
  for (const auto& p : impl.params) param_of[p.piece.unsafeGetTensorImpl()] = &p;
  std::ostringstream s;
  s << "FullyShardedDataParallel rank " << impl.group.rank() << " of " << impl.group.world_size();
  for (const auto& g : opt.param_groups()) {
    s << "; group:";
    for (const auto& t : g.params()) {
      const auto found = param_of.find(t.unsafeGetTensorImpl());
      if (found == param_of.end()) {
        s << " ?" << t.numel();
        continue;
      }
      const auto& p = *found->second;
      s << " " << p.name << "[" << (p.piece.numel() > 0 ? piece_begin(impl, p) : 0) << "+"
        << p.piece.numel() << "]";
    }
  }
  return s.str();
}

}  // namespace

void FullyShardedDataParallel::save_shard(torch::serialize::OutputArchive& archive,
                                          const torch::optim::Optimizer* optimizer) const {
  const char* who = "FullyShardedDataParallel::save_shard";
  const auto* opt = shard::checkpointable(optimizer, who);
  std::unordered_map<const c10::TensorImpl*, bool> in_optimizer;
  if (opt) {
    for (const auto& g : opt->param_groups()) {
      for (const auto& t : g.params()) in_optimizer[t.unsafeGetTensorImpl()] = true;
    }
  }
  std::vector<shard::SavedPiece> pieces;
  for (const auto& p : impl_->params) {
    if (p.piece.numel() == 0) continue;
    shard::SavedPiece s;
    s.name = p.name;
    s.numel = p.numel;
    s.begin = piece_begin(*impl_, p);
    s.value = p.piece;
    s.trains = opt && p.tensor.requires_grad();
    if (s.trains) {
      TORCH_CHECK(in_optimizer.count(p.piece.unsafeGetTensorImpl()), who, ": parameter '", p.name,
                  "' is not in the optimizer; build it over parameters()");
      s.step = opt->step_count(p.piece);
      s.exp_avg = opt->exp_avg(p.piece);
      s.exp_avg_sq = opt->exp_avg_sq(p.piece);
    }
    pieces.push_back(std::move(s));
  }
  shard::write_shard(archive, impl_->group.rank(), impl_->group.world_size(), pieces,
                     shard::buffers_of(*impl_->model), opt, opt ? layout_of(*impl_, *opt) : "");
}

void FullyShardedDataParallel::load_shards(int64_t saved_world_size, const ShardReader& read_shard,
                                           torch::optim::Optimizer* optimizer) {
  const char* who = "FullyShardedDataParallel::load_shards";
  auto& impl = *impl_;
  auto* opt = shard::checkpointable(optimizer, who);
  torch::NoGradGuard no_grad;
  std::string error;
  shard::Loaded loaded;
  std::string backup;  // the optimizer's state before, restored if a rank fails
  bool optimizer_loaded = false;
  try {
    std::vector<shard::PieceTarget> targets;
    for (const auto& p : impl.params) {
      const int64_t length = p.piece.numel();
      targets.push_back({p.name, p.numel, length > 0 ? piece_begin(impl, p) : 0, length,
                         p.tensor.requires_grad()});
    }
    loaded = shard::read_shards(
        who, saved_world_size, read_shard, targets, opt != nullptr, shard::buffers_of(*impl.model),
        {impl.group.rank(), impl.group.world_size(), opt ? layout_of(impl, *opt) : ""});
    if (opt) {
      std::unordered_map<const c10::TensorImpl*, size_t> index_of;
      for (size_t i = 0; i < impl.params.size(); ++i) {
        index_of[impl.params[i].piece.unsafeGetTensorImpl()] = i;
      }
      backup = shard::optimizer_bytes(*opt);
      shard::load_optimizer(who, *opt, loaded, [&](size_t g, size_t i) {
        const auto& t = opt->param_groups()[g].params()[i];
        const auto found = index_of.find(t.unsafeGetTensorImpl());
        TORCH_CHECK(found != index_of.end(), who, ": the optimizer's param ", i, " of group ", g,
                    " is not one of parameters()");
        const auto& r = loaded.pieces[found->second];
        return shard::OptimizerSlot{std::max<int64_t>(r.step, 0),
                                    r.has_exp_avg ? r.exp_avg : at::Tensor(),
                                    r.has_exp_avg_sq ? r.exp_avg_sq : at::Tensor()};
      });
      optimizer_loaded = true;
    }
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  shard::commit_everywhere(who, impl.group, error, [&] {
    if (optimizer_loaded) shard::restore_optimizer(*opt, backup);
  });
  // Nothing gathered from the masters before survives them (a gather in
  // flight is waited for first).
  for (auto& u : impl.units) impl.reshard(u);
  for (size_t i = 0; i < impl.params.size(); ++i) {
    if (impl.params[i].piece.numel() > 0) impl.params[i].piece.copy_(loaded.pieces[i].value);
  }
  for (const auto& b : impl.model->named_buffers()) b.value().copy_(loaded.buffers.at(b.key()));
  // New masters and FP8 scaling states: the next codes are cast anew.
  for (auto& u : impl.units) {
    for (auto& s : u.spaces) s.forget_casts();
  }
}

#else  // !AMPX_WITH_DIST

void FullyShardedDataParallel::save_shard(torch::serialize::OutputArchive&,
                                          const torch::optim::Optimizer*) const {
  TORCH_CHECK(false, "ampx::dist: this ampx was built without c10d/Gloo");
}
void FullyShardedDataParallel::load_shards(int64_t, const ShardReader&, torch::optim::Optimizer*) {
  TORCH_CHECK(false, "ampx::dist: this ampx was built without c10d/Gloo");
}

#endif

}  // namespace dist
}  // namespace ampx
