// ZeroRedundancyOptimizer's state: each rank's own (save/load, the same
// world size) and the shards by parameter name and element range that any
// number of ranks loads (save_shard/load_shards, the format of
// shard_pieces.h that FullyShardedDataParallel's checkpoints share).

#include "zero_impl.h"

#include "../files/safetensors/writer.h"
#include "shard_pieces.h"

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ampx {
namespace dist {

namespace {
constexpr int64_t kVersion = 1;
}  // namespace

std::vector<at::Tensor> ZeroRedundancyOptimizer::gather_masters() {
  auto& impl = *impl_;
  impl.build();
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> out(impl.params.size());
  for (size_t k = 0; k < impl.spaces.size(); ++k) {
    const auto& s = impl.spaces[k];
    auto whole = torch::empty({impl.world() * s.shard}, impl.masters[k].options());
    impl.group.all_gather(whole, impl.masters[k]);
    for (size_t j = 0; j < s.params.size(); ++j) {
      const auto& p = impl.params[static_cast<size_t>(s.params[j])];
      out[static_cast<size_t>(s.params[j])] =
          whole.narrow(0, s.offsets[j], p.numel()).view(p.sizes());
    }
  }
  return out;
}

void ZeroRedundancyOptimizer::save(torch::serialize::OutputArchive& archive) const {
  impl_->build();
  const auto& s = impl_->spaces;
  archive.write("ampx_zero_version", torch::tensor(kVersion));
  archive.write("rank", torch::tensor(impl_->rank()));
  archive.write("world_size", torch::tensor(impl_->world()));
  archive.write("spaces", torch::tensor(static_cast<int64_t>(s.size())));
  for (size_t k = 0; k < s.size(); ++k) {
    const auto key = "space" + std::to_string(k);
    archive.write(key + ".group", torch::tensor(s[k].group));
    archive.write(key + ".numel", torch::tensor(s[k].numel));
    archive.write(key + ".dtype", torch::tensor(static_cast<int64_t>(s[k].dtype)));
    archive.write(key + ".master", impl_->masters[k]);
  }
  torch::serialize::OutputArchive local;
  impl_->local->save(local);
  archive.write("local", local);
}

void ZeroRedundancyOptimizer::load(torch::serialize::InputArchive& archive) {
  impl_->build();
  auto read_int = [&](const std::string& key) {
    at::Tensor t;
    TORCH_CHECK(archive.try_read(key, t) && t.numel() == 1, "ZeroRedundancyOptimizer::load: no '",
                key, "' (not a ZeroRedundancyOptimizer state)");
    return t.item<int64_t>();
  };
  const int64_t version = read_int("ampx_zero_version");
  TORCH_CHECK(version == kVersion, "ZeroRedundancyOptimizer::load: state version ", version,
              ", this ampx reads ", kVersion);
  const int64_t rank = read_int("rank"), world = read_int("world_size");
  TORCH_CHECK(rank == impl_->rank() && world == impl_->world(),
              "ZeroRedundancyOptimizer::load: the state is rank ", rank, " of ", world,
              "'s shard; this is rank ", impl_->rank(), " of ", impl_->world(),
              " (each rank loads the shard it saved, with the same world size)");
  const auto& s = impl_->spaces;
  TORCH_CHECK(read_int("spaces") == static_cast<int64_t>(s.size()),
              "ZeroRedundancyOptimizer::load: the state has another number of parameter "
              "groups and dtypes than these parameters (",
              describe(s), ")");
  std::vector<at::Tensor> masters(s.size());
  for (size_t k = 0; k < s.size(); ++k) {
    const auto key = "space" + std::to_string(k);
    at::Tensor group_t;  // absent in states saved before param groups: one group
    const int64_t group = archive.try_read(key + ".group", group_t) ? group_t.item<int64_t>() : 0;
    const int64_t numel = read_int(key + ".numel"), dtype = read_int(key + ".dtype");
    TORCH_CHECK(
        group == s[k].group && numel == s[k].numel && dtype == static_cast<int64_t>(s[k].dtype),
        "ZeroRedundancyOptimizer::load: the state's parameters (", key, ": group ", group, ", ",
        numel, " of dtype #", dtype, ") are not these (", describe(s), ")");
    TORCH_CHECK(archive.try_read(key + ".master", masters[k]) &&
                    masters[k].sizes() == impl_->masters[k].sizes() &&
                    masters[k].scalar_type() == at::kFloat,
                "ZeroRedundancyOptimizer::load: '", key, ".master' is missing or not fp32 [",
                impl_->masters[k].numel(), "]");
  }
  torch::serialize::InputArchive local;
  TORCH_CHECK(archive.try_read("local", local),
              "ZeroRedundancyOptimizer::load: no 'local' optimizer state");
  impl_->local->load(local);  // checks its own state before changing it
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < s.size(); ++k) impl_->masters[k].copy_(masters[k]);
}

#if defined(AMPX_WITH_DIST)

namespace {

/// `model`'s parameter names by their index in `params`, every one of the
/// optimizer's parameters named once (built over model->parameters()).
std::vector<std::string> names_of(const std::vector<at::Tensor>& params,
                                  const torch::nn::Module& model, const char* who) {
  std::unordered_map<const c10::TensorImpl*, size_t> index_of;
  for (size_t i = 0; i < params.size(); ++i) index_of[params[i].unsafeGetTensorImpl()] = i;
  std::vector<std::string> names(params.size());
  const auto named = model.named_parameters();
  for (const auto& p : named) {
    const auto found = index_of.find(p.value().unsafeGetTensorImpl());
    TORCH_CHECK(found != index_of.end(), who, ": the model's parameter '", p.key(),
                "' is not one of this optimizer's; build it over model->parameters()");
    names[found->second] = p.key();
  }
  TORCH_CHECK(named.size() == params.size(), who, ": the model has ", named.size(),
              " parameters, this optimizer ", params.size(), "; build it over model->parameters()");
  return names;
}

/// Where parameter element range [a, b) of a space lies in this rank's shard.
struct Overlap {
  int64_t begin = 0, length = 0;  // in the parameter
  int64_t at = 0;                 // in the shard
};

Overlap overlap(int64_t lo, int64_t shard, int64_t offset, int64_t numel) {
  const int64_t a = std::max(lo, offset), b = std::min(lo + shard, offset + numel);
  if (a >= b) return {};
  return {a - offset, b - a, a - lo};
}

/// This rank's layout as a shard records it (shard::write_shard): the local
/// optimizer's params are the spaces' shards, each of its parameters' pieces
/// at a place in one.
std::string layout_of(int64_t rank, int64_t world, const std::vector<Space>& spaces,
                      const std::vector<std::string>& names) {
  std::ostringstream s;
  s << "ZeroRedundancyOptimizer rank " << rank << " of " << world;
  for (const auto& space : spaces) {
    s << "; group " << space.group << " " << space.dtype << " shard " << space.shard << ":";
    for (size_t j = 0; j < space.params.size(); ++j) {
      s << " " << names[static_cast<size_t>(space.params[j])] << "@" << space.offsets[j];
    }
  }
  return s.str();
}

}  // namespace

void ZeroRedundancyOptimizer::save_shard(torch::serialize::OutputArchive& archive,
                                         const torch::nn::Module& model) const {
  const char* who = "ZeroRedundancyOptimizer::save_shard";
  auto& impl = *impl_;
  impl.build();
  const auto* opt = shard::checkpointable(impl.local.get(), who);
  const auto names = names_of(impl.params, model, who);
  std::vector<shard::SavedPiece> pieces;
  for (size_t k = 0; k < impl.spaces.size(); ++k) {
    const auto& s = impl.spaces[k];
    const auto& master = impl.masters[k];
    const auto exp_avg = opt->exp_avg(master), exp_avg_sq = opt->exp_avg_sq(master);
    for (size_t j = 0; j < s.params.size(); ++j) {
      const auto& p = impl.params[static_cast<size_t>(s.params[j])];
      const Overlap o = overlap(impl.rank() * s.shard, s.shard, s.offsets[j], p.numel());
      if (o.length == 0) continue;
      shard::SavedPiece piece;
      piece.name = names[static_cast<size_t>(s.params[j])];
      piece.numel = p.numel();
      piece.begin = o.begin;
      piece.value = master.narrow(0, o.at, o.length);
      piece.trains = p.requires_grad();
      piece.step = opt->step_count(master);
      if (exp_avg.defined()) piece.exp_avg = exp_avg.narrow(0, o.at, o.length);
      if (exp_avg_sq.defined()) piece.exp_avg_sq = exp_avg_sq.narrow(0, o.at, o.length);
      pieces.push_back(std::move(piece));
    }
  }
  shard::write_shard(archive, impl.rank(), impl.world(), pieces, shard::buffers_of(model), opt,
                     layout_of(impl.rank(), impl.world(), impl.spaces, names));
}

void ZeroRedundancyOptimizer::load_shards(int64_t saved_world_size, const ShardReader& read_shard,
                                          torch::nn::Module& model) {
  const char* who = "ZeroRedundancyOptimizer::load_shards";
  auto& impl = *impl_;
  impl.build();
  auto* opt = shard::checkpointable(impl.local.get(), who);
  torch::NoGradGuard no_grad;
  const size_t n = impl.spaces.size();
  std::vector<at::Tensor> masters(n), exp_avg(n), exp_avg_sq(n);
  std::vector<int64_t> steps(n, -1);
  std::string error, backup;
  bool optimizer_loaded = false;
  shard::Loaded loaded;
  try {
    const auto names = names_of(impl.params, model, who);
    std::vector<shard::PieceTarget> targets;
    std::vector<std::pair<size_t, Overlap>> where;  // each target's space and place
    for (size_t k = 0; k < n; ++k) {
      const auto& s = impl.spaces[k];
      for (size_t j = 0; j < s.params.size(); ++j) {
        const auto& p = impl.params[static_cast<size_t>(s.params[j])];
        const Overlap o = overlap(impl.rank() * s.shard, s.shard, s.offsets[j], p.numel());
        targets.push_back({names[static_cast<size_t>(s.params[j])], p.numel(), o.begin, o.length,
                           p.requires_grad()});
        where.emplace_back(k, o);
      }
    }
    loaded = shard::read_shards(
        who, saved_world_size, read_shard, targets, true, shard::buffers_of(model),
        {impl.rank(), impl.world(), layout_of(impl.rank(), impl.world(), impl.spaces, names)});
    for (size_t k = 0; k < n; ++k) masters[k] = torch::zeros_like(impl.masters[k]);
    for (size_t t = 0; t < targets.size(); ++t) {
      const auto& [k, o] = where[t];
      const auto& r = loaded.pieces[t];
      if (o.length == 0) continue;
      masters[k].narrow(0, o.at, o.length).copy_(r.value);
      if (r.step < 0) continue;  // no optimizer state (a frozen parameter)
      TORCH_CHECK(steps[k] < 0 || steps[k] == r.step, who, ": parameter '", targets[t].name,
                  "' was saved at optimizer step ", r.step,
                  ", another piece of this rank's shard "
                  "at step ",
                  steps[k], "; ZeroRedundancyOptimizer steps its shard as one");
      steps[k] = r.step;
      if (r.has_exp_avg) {
        if (!exp_avg[k].defined()) exp_avg[k] = torch::zeros_like(impl.masters[k]);
        exp_avg[k].narrow(0, o.at, o.length).copy_(r.exp_avg);
      }
      if (r.has_exp_avg_sq) {
        if (!exp_avg_sq[k].defined()) exp_avg_sq[k] = torch::zeros_like(impl.masters[k]);
        exp_avg_sq[k].narrow(0, o.at, o.length).copy_(r.exp_avg_sq);
      }
    }
    std::unordered_map<const c10::TensorImpl*, size_t> space_of;
    for (size_t k = 0; k < n; ++k) space_of[impl.masters[k].unsafeGetTensorImpl()] = k;
    backup = shard::optimizer_bytes(*opt);
    shard::load_optimizer(who, *opt, loaded, [&](size_t g, size_t i) {
      const auto& t = opt->param_groups()[g].params()[i];
      const size_t k = space_of.at(t.unsafeGetTensorImpl());
      return shard::OptimizerSlot{std::max<int64_t>(steps[k], 0), exp_avg[k], exp_avg_sq[k]};
    });
    optimizer_loaded = true;
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  shard::commit_everywhere(who, impl.group, error, [&] {
    if (optimizer_loaded) shard::restore_optimizer(*opt, backup);
  });
  for (size_t k = 0; k < n; ++k) impl.masters[k].copy_(masters[k]);
  for (const auto& b : model.named_buffers()) b.value().copy_(loaded.buffers.at(b.key()));
  impl.gather_parameters();  // the model's parameters from the masters, in their dtypes
}

void ZeroRedundancyOptimizer::save_full_safetensors(
    const std::string& path, const torch::nn::Module& model,
    const std::map<std::string, std::string>& metadata, c10::ScalarType dtype) {
  const char* who = "ZeroRedundancyOptimizer::save_full_safetensors";
  shard::check_export_dtype(who, dtype);
  auto& impl = *impl_;
  impl.build();
  // The same model gives the same check everywhere: every rank throws or none.
  const auto names = names_of(impl.params, model, who);
  const auto buffers = model.named_buffers();
  std::optional<ampx::detail::SafetensorsFileWriter> file;
  std::string error;
  const auto attempt = [&](const std::function<void()>& write) {
    if (!file || !error.empty()) return;
    try {
      write();
    } catch (const std::exception& e) {
      error = message_of(e);
    }
  };
  if (impl.rank() == 0) {
    try {
      std::vector<ampx::detail::SafetensorsEntry> entries;
      for (size_t i = 0; i < names.size(); ++i) {
        entries.push_back({names[i], dtype, impl.params[i].sizes().vec()});
      }
      for (const auto& b : buffers) {
        entries.push_back({b.key(), b.value().scalar_type(), b.value().sizes().vec()});
      }
      file.emplace(path, entries, metadata, "writing safetensors");
    } catch (const std::exception& e) {
      error = message_of(e);
    }
  }
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < impl.spaces.size(); ++k) {
    const auto& s = impl.spaces[k];
    const int64_t most = impl.piece_elements(s, static_cast<int64_t>(sizeof(float)));
    auto buffer = torch::empty({impl.world() * most}, impl.masters[k].options());
    for (int64_t at = 0; at < s.shard; at += most) {
      const int64_t n = std::min(most, s.shard - at);
      auto gathered = buffer.narrow(0, 0, impl.world() * n);
      impl.group.all_gather(gathered, impl.masters[k].narrow(0, at, n));
      attempt([&] {  // rank 0: each rank's part where its parameters' elements go
        for (int64_t r = 0; r < impl.world(); ++r) {
          const int64_t lo = r * s.shard + at;
          for (size_t j = 0; j < s.params.size(); ++j) {
            const int64_t i = s.params[j];
            const auto o = overlap(lo, n, s.offsets[j], impl.params[i].numel());
            if (o.length == 0) continue;
            file->write_part(names[i], o.begin,
                             gathered.narrow(0, r * n + o.at, o.length).to(dtype));
          }
        }
      });
    }
  }
  attempt([&] {
    for (const auto& b : buffers) file->write(b.key(), b.value());
    file->commit();
  });
  file.reset();  // an uncommitted file's temp file goes before the others hear of it
  shard::throw_rank0_error(who, impl.group, error);
}

#else  // !AMPX_WITH_DIST

void ZeroRedundancyOptimizer::save_full_safetensors(const std::string&, const torch::nn::Module&,
                                                    const std::map<std::string, std::string>&,
                                                    c10::ScalarType) {
  TORCH_CHECK(false, "ampx::dist: this ampx was built without c10d/Gloo");
}
void ZeroRedundancyOptimizer::save_shard(torch::serialize::OutputArchive&,
                                         const torch::nn::Module&) const {
  TORCH_CHECK(false, "ampx::dist: this ampx was built without c10d/Gloo");
}
void ZeroRedundancyOptimizer::load_shards(int64_t, const ShardReader&, torch::nn::Module&) {
  TORCH_CHECK(false, "ampx::dist: this ampx was built without c10d/Gloo");
}

#endif

}  // namespace dist
}  // namespace ampx
