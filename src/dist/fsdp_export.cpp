// FullyShardedDataParallel's full state: every parameter gathered at full
// size one unit at a time, as a map (full_state_dict), to a visitor
// (for_each_full_parameter), or streamed into a safetensors file by rank 0
// (save_full_safetensors: src/files/safetensors/writer.h places each tensor
// where save_safetensors() would, so rank 0 never holds the whole model).

#include "ampx/fsdp.h"

#include "../files/safetensors/writer.h"
#include "fsdp_impl.h"
#include "process_group_impl.h"
#include "shard_pieces.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace ampx {
namespace dist {

#if defined(AMPX_WITH_DIST)

namespace {

using Visit = std::function<void(const std::string&, const at::Tensor&)>;

/// Gathers each unit's spaces in turn and, on rank 0, calls `visit` on each
/// parameter of it. Every rank takes part in every gather, whatever `visit`
/// does: its first error stops the calls, and is returned (rank 0's; ""
/// elsewhere and without one).
std::string gather_each(FullyShardedDataParallel::Impl& impl, const Visit& visit) {
  torch::NoGradGuard no_grad;
  const bool root = impl.group.rank() == 0;
  std::string error;
  for (auto& u : impl.units) {
    for (auto& s : u.spaces) {
      auto flat = torch::empty({s.master.numel() * impl.group.world_size()}, s.master.options());
      impl.group.all_gather(flat, s.master);
      if (!root || !error.empty()) continue;
      try {
        for (const int64_t i : s.params) {
          const auto& p = impl.params[static_cast<size_t>(i)];
          visit(p.name, flat.narrow(0, p.offset, p.numel).view(p.shape));
        }
      } catch (const std::exception& e) {
        error = message_of(e);
      }
    }
  }
  return error;
}

}  // namespace

torch::OrderedDict<std::string, at::Tensor> FullyShardedDataParallel::full_state_dict() {
  std::unordered_map<std::string, at::Tensor> values;
  const auto error = gather_each(*impl_, [&](const std::string& name, const at::Tensor& value) {
    values[name] = value.clone();
  });
  shard::throw_rank0_error("FullyShardedDataParallel::full_state_dict", impl_->group, error);
  torch::OrderedDict<std::string, at::Tensor> out;
  if (impl_->group.rank() != 0) return out;
  for (const auto& p : impl_->params) out.insert(p.name, values.at(p.name));
  for (const auto& b : impl_->model->named_buffers()) out.insert(b.key(), b.value().clone());
  return out;
}

void FullyShardedDataParallel::for_each_full_parameter(const Visit& visit) {
  shard::throw_rank0_error("FullyShardedDataParallel::for_each_full_parameter", impl_->group,
                           gather_each(*impl_, visit));
}

void FullyShardedDataParallel::save_full_safetensors(
    const std::string& path, const std::map<std::string, std::string>& metadata,
    c10::ScalarType dtype) {
  const char* who = "FullyShardedDataParallel::save_full_safetensors";
  shard::check_export_dtype(who, dtype);
  std::optional<ampx::detail::SafetensorsFileWriter> file;
  std::string error;
  const auto buffers = impl_->model->named_buffers();
  if (impl_->group.rank() == 0) {
    try {
      std::vector<ampx::detail::SafetensorsEntry> entries;
      for (const auto& p : impl_->params) entries.push_back({p.name, dtype, p.shape});
      for (const auto& b : buffers) {
        entries.push_back({b.key(), b.value().scalar_type(), b.value().sizes().vec()});
      }
      file.emplace(path, entries, metadata, "writing safetensors");
    } catch (const std::exception& e) {
      error = message_of(e);
    }
  }
  // Rank 0 without a file still takes part in the gathers, writing nothing.
  const auto gathered = gather_each(*impl_, [&](const std::string& name, const at::Tensor& value) {
    if (file) file->write(name, value.to(dtype));
  });
  if (error.empty()) error = gathered;
  if (file && error.empty()) {
    try {
      for (const auto& b : buffers) file->write(b.key(), b.value());
      file->commit();
    } catch (const std::exception& e) {
      error = message_of(e);
    }
  }
  file.reset();  // an uncommitted file's temp file goes before the others hear of it
  shard::throw_rank0_error(who, impl_->group, error);
}

#else  // !AMPX_WITH_DIST

torch::OrderedDict<std::string, at::Tensor> FullyShardedDataParallel::full_state_dict() {
  return {};
}
void FullyShardedDataParallel::for_each_full_parameter(
    const std::function<void(const std::string&, const at::Tensor&)>&) {}
void FullyShardedDataParallel::save_full_safetensors(const std::string&,
                                                     const std::map<std::string, std::string>&,
                                                     c10::ScalarType) {}

#endif

}  // namespace dist
}  // namespace ampx
