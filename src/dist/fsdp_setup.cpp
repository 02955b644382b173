// FullyShardedDataParallel's construction (units, flat spaces, shards,
// hooks), and what reads the shards: parameters(), clipping, the full state.

#include "ampx/fsdp.h"

#include "../norm_layers.h"
#include "ampx/fp8/scaling.h"
#include "fsdp_impl.h"
#include "model_check.h"
#include "process_group_impl.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ampx {
namespace dist {

#if defined(AMPX_WITH_DIST)

namespace {

bool is_fsdp_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

/// Calls Impl::on_grad after the engine accumulates a parameter's gradient.
class GradAccumulated : public torch::autograd::FunctionPostHook {
 public:
  GradAccumulated(std::shared_ptr<fsdp::Impl*> link, int64_t param)
      : link_(std::move(link)), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (*link_ != nullptr) (*link_)->on_grad(param_);
    return outputs;
  }

 private:
  std::shared_ptr<fsdp::Impl*> link_;
  int64_t param_;
};

/// What the ranks must agree on: the model and the options.
std::vector<std::pair<std::string, std::string>> describe_sharded(
    const torch::nn::Module& model, const std::vector<std::string>& unit_names,
    const FullyShardedDataParallelOptions& o) {
  auto out = ampx::detail::describe_module(model);
  std::string units;
  for (const auto& n : unit_names) units += (units.empty() ? "" : ", ") + n;
  out.emplace_back("units", units);
  out.emplace_back("option param_dtype", c10::toString(o.param_dtype()));
  out.emplace_back("option reduce_dtype", c10::toString(o.reduce_dtype()));
  out.emplace_back("option reshard_after_forward", o.reshard_after_forward() ? "true" : "false");
  out.emplace_back("option prefetch", o.prefetch() ? "true" : "false");
  out.emplace_back("option keep_norms_fp32", o.keep_norms_fp32() ? "true" : "false");
  out.emplace_back("option broadcast_parameters", o.broadcast_parameters() ? "true" : "false");
  out.emplace_back("option fp8_all_gather", o.fp8_all_gather() ? "true" : "false");
  return out;
}

/// Throws, on every rank alike, when this Gloo (or NCCL) cannot sum `type`.
void check_reduce_dtype(const ProcessGroup& group, at::ScalarType type, c10::Device device) {
  if (type == at::kFloat) return;
  auto probe = torch::ones({1}, torch::TensorOptions().dtype(type).device(device));
  try {
    group.all_reduce_sum(probe);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "FullyShardedDataParallel: this LibTorch's ",
                device.is_cuda() && group.has_nccl() ? "NCCL" : "Gloo", " cannot sum ", type,
                " (reduce_dtype); use float32: ", e.what_without_backtrace());
  }
}

/// Each unit's name in the model, after checking that it is a submodule,
/// listed once.
std::vector<std::string> unit_names_in(
    const torch::nn::Module& model, const std::vector<std::shared_ptr<torch::nn::Module>>& units) {
  std::unordered_map<const torch::nn::Module*, std::string> names;
  for (const auto& m : model.named_modules()) {
    names.emplace(m.value().get(), m.key().empty() ? "(the model)" : m.key());
  }
  std::vector<std::string> out;
  for (size_t k = 0; k < units.size(); ++k) {
    TORCH_CHECK(units[k] != nullptr, "FullyShardedDataParallel: units[", k, "] is null");
    const auto it = names.find(units[k].get());
    TORCH_CHECK(it != names.end(), "FullyShardedDataParallel: units[", k,
                "] is not a submodule of the model");
    for (size_t j = 0; j < k; ++j) {
      TORCH_CHECK(units[j] != units[k], "FullyShardedDataParallel: units[", j, "] and units[", k,
                  "] are the same module, '", it->second, "'");
    }
    out.push_back(it->second);
  }
  return out;
}

/// Puts each of the model's parameters in its unit (the innermost listed
/// one holding it: the one with the fewest parameters; the root last) and
/// in that unit's flat space of its gather dtype. Returns their device.
c10::optional<c10::Device> lay_out(fsdp::Impl& impl,
                                   const std::vector<std::shared_ptr<torch::nn::Module>>& units) {
  std::unordered_map<const c10::TensorImpl*, torch::nn::Module*> owner;  // direct
  for (const auto& m : impl.model->modules()) {
    for (const auto& p : m->parameters(/*recurse=*/false)) {
      owner.emplace(p.unsafeGetTensorImpl(), m.get());
    }
  }
  std::vector<std::set<const c10::TensorImpl*>> held(units.size());
  for (size_t k = 0; k < units.size(); ++k) {
    for (const auto& p : units[k]->parameters()) held[k].insert(p.unsafeGetTensorImpl());
  }
  // (unit, dtype, kind) -> space; kind: 0 plain, 1 FP8 weights, 2 + the
  // parameter's index for a block-scaled weight (a space of its own).
  std::map<std::tuple<int64_t, int, int64_t>, int64_t> space_of;
  c10::optional<c10::Device> device;
  for (const auto& np : impl.model->named_parameters()) {
    const auto& t = np.value();
    TORCH_CHECK(t.scalar_type() == at::kFloat, "FullyShardedDataParallel: parameter '", np.key(),
                "' is ", t.scalar_type(),
                "; build the model in float32: its values become the fp32 masters "
                "(param_dtype sets the dtype units compute in)");
    TORCH_CHECK(!device || *device == t.device(), "FullyShardedDataParallel: parameter '", np.key(),
                "' is on ", t.device(), ", the others on ", *device);
    device = t.device();
    int64_t unit = -1;
    for (size_t k = 0; k < units.size(); ++k) {
      if (held[k].count(t.unsafeGetTensorImpl()) &&
          (unit < 0 || held[k].size() < held[static_cast<size_t>(unit)].size())) {
        unit = static_cast<int64_t>(k);
      }
    }
    auto& module = *owner.at(t.unsafeGetTensorImpl());
    const bool fp32 = impl.options.keep_norms_fp32() && ampx::detail::is_norm_layer(module);
    const auto dtype = fp32 ? at::kFloat : impl.options.param_dtype();
    auto* fp8_layer = impl.options.fp8_all_gather() ? fsdp::fp8_layer_of(module, t) : nullptr;
    std::shared_ptr<fsdp::BlockGather> block;
    if (fp8_layer != nullptr && fsdp::is_block_scaled(*fp8_layer)) {
      block = fsdp::block_gather_of(*fp8_layer, t, impl.group.world_size());
      if (!block) fp8_layer = nullptr;  // mostly padding: gathered with the unit's others
    }
    auto& u = impl.units[static_cast<size_t>(unit)];
    const int64_t kind =
        block ? 2 + static_cast<int64_t>(impl.params.size()) : (fp8_layer != nullptr ? 1 : 0);
    const auto key = std::make_tuple(unit, static_cast<int>(dtype), kind);
    if (!space_of.count(key)) {
      space_of[key] = static_cast<int64_t>(u.spaces.size());
      u.spaces.emplace_back();
      u.spaces.back().dtype = dtype;
      u.spaces.back().fp8 = fp8_layer != nullptr;
      u.spaces.back().block = std::move(block);
    }
    fsdp::Param p;
    p.fp8_layer = fp8_layer;
    p.name = np.key();
    p.tensor = t;
    p.shape = t.sizes().vec();
    p.numel = t.numel();
    p.unit = unit;
    p.space = space_of[key];
    auto& s = u.spaces[static_cast<size_t>(p.space)];
    p.offset = s.numel;
    s.numel += p.numel;
    s.params.push_back(static_cast<int64_t>(impl.params.size()));
    if (t.requires_grad()) {
      ++s.grads_expected;
      ++u.grads_expected;
    }
    impl.params.push_back(std::move(p));
  }
  return device;
}

/// Cuts each space into shards (rank r keeps elements [r S, (r+1) S) of it,
/// padded; a block-scaled weight's S whole blocks of rows), makes this
/// rank's pieces, hooks the gradient accumulators and empties the module's
/// parameters.
void cut_shards(fsdp::Impl& impl, c10::Device device) {
  const int64_t world = impl.group.world_size(), rank = impl.group.rank();
  const auto fp32 = torch::TensorOptions().dtype(at::kFloat).device(device);
  for (auto& u : impl.units) {
    for (auto& s : u.spaces) {
      const int64_t shard =
          s.block ? s.block->shard_rows * s.block->cols : (s.numel + world - 1) / world;
      auto flat = torch::zeros({shard * world}, fp32);
      for (const int64_t i : s.params) {
        const auto& p = impl.params[static_cast<size_t>(i)];
        flat.narrow(0, p.offset, p.numel).copy_(p.tensor.reshape({-1}));
      }
      s.master = flat.narrow(0, rank * shard, shard).clone();
      s.gathered = torch::empty({shard * world}, fp32.dtype(s.dtype));
      fsdp::release_storage(s.gathered);
      if (s.fp8 && !s.block) {  // a block space's landing buffer is made per gather
        s.codes = torch::empty({shard * world}, fp32.dtype(at::kByte));
        fsdp::release_storage(s.codes);
      }
      for (const int64_t i : s.params) {
        auto& p = impl.params[static_cast<size_t>(i)];
        const int64_t begin = std::max(p.offset, rank * shard);
        const int64_t end = std::min(p.offset + p.numel, (rank + 1) * shard);
        const int64_t length = std::max<int64_t>(end - begin, 0);
        p.piece_offset = length > 0 ? begin - rank * shard : 0;
        p.piece = s.master.narrow(0, p.piece_offset, length);
        if (p.tensor.requires_grad()) p.piece.requires_grad_(true);
        // The gradient accumulator records the parameter's shape and dtype when
        // it is made: make it at the gathered shape, then free the parameter.
        p.placeholder = torch::empty({0}, fp32.dtype(s.dtype));
        if (s.fp8) p.stand_in = fp8::weight_stand_in(p.shape, fp32.dtype(s.dtype));
        p.tensor.set_data(torch::empty(p.shape, fp32.dtype(s.dtype)));
        if (p.tensor.requires_grad()) {
          p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
          p.accumulator->add_post_hook(std::make_unique<GradAccumulated>(impl.link_, i));
        }
        p.tensor.set_data(p.placeholder);
      }
    }
  }
}

}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(
    std::shared_ptr<torch::nn::Module> model, ProcessGroup group,
    std::vector<std::shared_ptr<torch::nn::Module>> units,
    FullyShardedDataParallelOptions options) {
  TORCH_CHECK(model != nullptr, "FullyShardedDataParallel: model is null");
  TORCH_CHECK(is_fsdp_dtype(options.param_dtype()),
              "FullyShardedDataParallel: param_dtype must be float32, bfloat16 or float16, got ",
              options.param_dtype());
  TORCH_CHECK(is_fsdp_dtype(options.reduce_dtype()),
              "FullyShardedDataParallel: reduce_dtype must be float32, bfloat16 or float16, got ",
              options.reduce_dtype());
  auto unit_names = unit_names_in(*model, units);
  ampx::detail::check_same_on_every_rank(describe_sharded(*model, unit_names, options), group,
                                         "FullyShardedDataParallel");
  impl_ = std::make_unique<Impl>(model, group, options);
  auto& impl = *impl_;
  torch::NoGradGuard no_grad;
  if (options.broadcast_parameters()) ampx::detail::broadcast_from_rank_zero(*model, group);
  if (std::find(units.begin(), units.end(), model) == units.end()) {
    units.push_back(model);  // the root
    unit_names.push_back("(the model)");
  }
  impl.units.resize(units.size());
  for (size_t k = 0; k < units.size(); ++k) {
    auto& u = impl.units[k];
    u.impl = &impl;
    u.module = units[k].get();
    u.name = unit_names[k];
    u.index = static_cast<int64_t>(k);
  }
  const auto device = lay_out(impl, units);
  if (device) {
    check_reduce_dtype(group, options.reduce_dtype(), *device);
    cut_shards(impl, *device);
    if (device->is_cuda() && group.has_nccl()) impl.streams.emplace(fsdp::SideStreams::on(*device));
  }
  fsdp::register_units(impl.units);
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  if (!impl_) return;
  *impl_->link_ = nullptr;
  fsdp::unregister_units(impl_->units);
}

torch::OrderedDict<std::string, at::Tensor> FullyShardedDataParallel::named_parameters() const {
  torch::OrderedDict<std::string, at::Tensor> out;
  for (const auto& p : impl_->params) {
    if (p.tensor.requires_grad() && p.piece.numel() > 0) out.insert(p.name, p.piece);
  }
  return out;
}

std::vector<at::Tensor> FullyShardedDataParallel::parameters() const {
  return named_parameters().values();
}

double FullyShardedDataParallel::clip_grad_norm_(double max_norm) {
  TORCH_CHECK(max_norm > 0.0,
              "FullyShardedDataParallel::clip_grad_norm_: max_norm must be > 0, got ", max_norm);
  std::vector<at::Tensor> grads;
  for (const auto& p : impl_->params) {
    if (p.piece.defined() && p.piece.grad().defined()) grads.push_back(p.piece.grad());
  }
  return ampx::detail::clip_sharded_grad_norm(grads, impl_->group, max_norm);
}

std::function<at::Tensor(const std::vector<at::Tensor>&, const at::Tensor&)>
FullyShardedDataParallel::piece_sums() const {
  const Impl* impl = impl_.get();
  // The pieces are made once, at construction: each one's row, once.
  std::unordered_map<const c10::TensorImpl*, int64_t> index;
  for (size_t i = 0; i < impl->params.size(); ++i) {
    const auto& piece = impl->params[i].piece;
    if (piece.defined()) index[piece.unsafeGetTensorImpl()] = static_cast<int64_t>(i);
  }
  return [impl, index = std::move(index)](const std::vector<at::Tensor>& pieces,
                                          const at::Tensor& sums) {
    const char* who = "FullyShardedDataParallel::piece_sums";
    TORCH_CHECK(sums.dim() == 2 && sums.size(0) == static_cast<int64_t>(pieces.size()), who,
                ": sums must be [pieces, k], got ", sums.sizes(), " for ", pieces.size(),
                " pieces");
    std::vector<int64_t> rows;
    for (size_t j = 0; j < pieces.size(); ++j) {
      const auto found = index.find(pieces[j].unsafeGetTensorImpl());
      TORCH_CHECK(found != index.end(), who, ": piece ", j, " is not one of parameters()");
      rows.push_back(found->second);
    }
    const auto row_index = torch::tensor(rows, torch::kLong);
    auto whole = torch::zeros({static_cast<int64_t>(impl->params.size()), sums.size(1)},
                              sums.options().dtype(torch::kDouble));
    whole.index_add_(0, row_index, sums.to(torch::kDouble));
    impl->group.all_reduce_sum(whole);
    return whole.index_select(0, row_index);
  };
}

int64_t FullyShardedDataParallel::sharded_bytes() const {
  int64_t bytes = 0;
  for (const auto& u : impl_->units) {
    for (const auto& s : u.spaces) bytes += s.master.numel() * 4;
  }
  for (const auto& p : impl_->params) {
    if (p.piece.defined() && p.piece.grad().defined()) bytes += p.piece.numel() * 4;
  }
  return bytes;
}

int64_t FullyShardedDataParallel::peak_gathered_bytes() const {
  return impl_->peak_gathered_bytes;
}

int64_t FullyShardedDataParallel::bytes_communicated() const {
  return impl_->bytes_communicated;
}

std::vector<std::vector<std::string>> FullyShardedDataParallel::unit_layout() const {
  std::vector<std::vector<std::string>> out(impl_->units.size());
  for (const auto& p : impl_->params) out[static_cast<size_t>(p.unit)].push_back(p.name);
  return out;
}

const std::shared_ptr<torch::nn::Module>& FullyShardedDataParallel::module() const {
  return impl_->model;
}

const FullyShardedDataParallelOptions& FullyShardedDataParallel::options() const {
  return impl_->options;
}

#else  // !AMPX_WITH_DIST

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<torch::nn::Module>, ProcessGroup,
                                                   std::vector<std::shared_ptr<torch::nn::Module>>,
                                                   FullyShardedDataParallelOptions) {
  TORCH_CHECK(false, "ampx::dist: this ampx was built without c10d/Gloo");
}
FullyShardedDataParallel::~FullyShardedDataParallel() = default;
torch::OrderedDict<std::string, at::Tensor> FullyShardedDataParallel::named_parameters() const {
  return {};
}
std::vector<at::Tensor> FullyShardedDataParallel::parameters() const {
  return {};
}
double FullyShardedDataParallel::clip_grad_norm_(double) {
  return 0.0;
}
std::function<at::Tensor(const std::vector<at::Tensor>&, const at::Tensor&)>
FullyShardedDataParallel::piece_sums() const {
  return {};
}
int64_t FullyShardedDataParallel::sharded_bytes() const {
  return 0;
}
int64_t FullyShardedDataParallel::peak_gathered_bytes() const {
  return 0;
}
int64_t FullyShardedDataParallel::bytes_communicated() const {
  return 0;
}
std::vector<std::vector<std::string>> FullyShardedDataParallel::unit_layout() const {
  return {};
}
const std::shared_ptr<torch::nn::Module>& FullyShardedDataParallel::module() const {
  static const std::shared_ptr<torch::nn::Module> none;
  return none;
}
const FullyShardedDataParallelOptions& FullyShardedDataParallel::options() const {
  static const FullyShardedDataParallelOptions defaults;
  return defaults;
}

#endif

}  // namespace dist

AmpSession initialize(dist::FullyShardedDataParallel& model, const AmpOptions& options) {
  return detail::initialize_sharded(model.module(), options, model.options().param_dtype(),
                                    model.options().keep_norms_fp32());
}

}  // namespace ampx
