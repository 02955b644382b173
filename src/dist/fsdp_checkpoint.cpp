// FullyShardedDataParallel's checkpoints: each rank saves its shard, keyed
// by parameter name and element range, never by rank layout, so that any
// number of ranks can load them (resharding).
//
// A shard's archive (version 1):
//   ampx_fsdp_shard_version 1        rank, world_size      ints
//   num_params K                     param<k>.name         str
//   param<k>.numel   the whole parameter's elements
//   param<k>.begin   the element of the parameter where this piece starts
//   param<k>.value   fp32 [length]: the piece (the masters)
//   param<k>.step, param<k>.exp_avg, param<k>.exp_avg_sq   the optimizer's, when given
//   num_buffers B                    buffer<j>.name, buffer<j>.value
//   optimizer.type, optimizer.seed, optimizer.num_groups, optimizer.group<g>.lr
// load_shards() writes the optimizer's part for ampx::optim's own load()
// (src/optim/optimizer_state.cpp's position keys), which checks it again.

#include "ampx/fsdp.h"

#include "ampx/optim/optimizer.h"
#include "fsdp_impl.h"
#include "process_group_impl.h"

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ampx {
namespace dist {

#if defined(AMPX_WITH_DIST)

namespace {

constexpr int64_t kShardVersion = 1;
constexpr int64_t kOptimStateVersion = 1;  // src/optim/optimizer_state.cpp's

/// `o` as one of ampx::optim's optimizers (null: none); another kind is refused.
template <typename Optimizer>
auto* mixed_precision(Optimizer* o, const char* who) {
  using Mixed =
      std::conditional_t<std::is_const_v<Optimizer>, const ampx::optim::MixedPrecisionOptimizer,
                         ampx::optim::MixedPrecisionOptimizer>;
  if (o == nullptr) return static_cast<Mixed*>(nullptr);
  auto* mixed = dynamic_cast<Mixed*>(o);
  TORCH_CHECK(mixed != nullptr, who,
              ": optimizer must be one of ampx::optim's (AdamW, SGD, LAMB), whose state is saved "
              "by parameter; got another torch::optim::Optimizer");
  const auto& c = mixed->config();
  TORCH_CHECK(c.state_format == ampx::optim::StateFormat::kFp32 && !c.kahan_summation, who,
              ": the optimizer keeps ",
              c.kahan_summation ? std::string("Kahan compensations")
                                : std::string("state_format ") +
                                      ampx::optim::state_format_name(c.state_format) + " moments",
              ", which sharded checkpoints do not carry yet (they keep fp32 moments); save the "
              "optimizer with its own save() on each rank instead");
  return mixed;
}

/// The element of `p` where this rank's piece starts.
int64_t piece_begin(const fsdp::Impl& impl, const fsdp::Param& p) {
  const auto& space = impl.units[static_cast<size_t>(p.unit)].spaces[static_cast<size_t>(p.space)];
  return impl.group.rank() * space.master.numel() + p.piece_offset - p.offset;
}

std::string key(const char* kind, int64_t k, const char* field) {
  return kind + std::to_string(k) + "." + field;
}

/// Reads saved archives, naming the saved rank in its errors.
class ShardFields {
 public:
  ShardFields(torch::serialize::InputArchive& archive, int64_t rank)
      : archive_(archive), where_("saved rank " + std::to_string(rank) + "'s shard") {}

  c10::IValue value(const std::string& k) const {
    c10::IValue v;
    TORCH_CHECK(archive_.try_read(k, v), where_, " has no '", k,
                "' (not a FullyShardedDataParallel shard, or a damaged one)");
    return v;
  }
  bool has(const std::string& k) const {
    c10::IValue v;
    return archive_.try_read(k, v);
  }
  int64_t integer(const std::string& k) const {
    const auto v = value(k);
    TORCH_CHECK(v.isInt(), where_, ": '", k, "' should be an int, got ", v.tagKind());
    return v.toInt();
  }
  std::string text(const std::string& k) const {
    const auto v = value(k);
    TORCH_CHECK(v.isString(), where_, ": '", k, "' should be a str, got ", v.tagKind());
    return v.toStringRef();
  }
  double real(const std::string& k) const {
    const auto v = value(k);
    TORCH_CHECK(v.isDouble(), where_, ": '", k, "' should be a float, got ", v.tagKind());
    return v.toDouble();
  }
  /// A 1-D fp32 tensor of `length` elements.
  at::Tensor vector(const std::string& k, int64_t length) const {
    at::Tensor t;
    TORCH_CHECK(archive_.try_read(k, t, /*is_buffer=*/true), where_, " has no tensor '", k, "'");
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.numel() == length, where_, ": '",
                k, "' is ", t.scalar_type(), " ", t.sizes(), ", expected Float [", length, "]");
    return t;
  }
  bool try_tensor(const std::string& k, at::Tensor& t) const {
    return archive_.try_read(k, t, /*is_buffer=*/true);
  }
  const std::string& where() const { return where_; }

 private:
  torch::serialize::InputArchive& archive_;
  std::string where_;
};

/// One of this rank's pieces as the saved shards rebuild it.
struct Rebuilt {
  int64_t begin = 0, length = 0;  // in the parameter
  at::Tensor value, exp_avg, exp_avg_sq;
  int64_t step = -1;  // -1: no saved piece carried optimizer state yet
  bool has_exp_avg = false, has_exp_avg_sq = false;
  std::vector<std::pair<int64_t, int64_t>> spans;  // [from, to) in the parameter, filled
};

/// The optimizer-wide part of a shard.
struct OptimizerHeader {
  std::string type;
  int64_t seed = 0;
  std::vector<double> lrs;
  bool operator==(const OptimizerHeader& o) const {
    return type == o.type && seed == o.seed && lrs == o.lrs;
  }
};

/// Reads saved rank `rank`'s shard into `rebuilt` (this rank's pieces, by
/// parameter index) and `buffers`; returns its optimizer header.
OptimizerHeader read_shard_into(const fsdp::Impl& impl, torch::serialize::InputArchive& archive,
                                int64_t rank, int64_t saved_world, bool with_optimizer,
                                const std::unordered_map<std::string, size_t>& by_name,
                                std::vector<Rebuilt>& rebuilt,
                                std::map<std::string, at::Tensor>& buffers) {
  const ShardFields f(archive, rank);
  const int64_t version = f.integer("ampx_fsdp_shard_version");
  TORCH_CHECK(version == kShardVersion, f.where(), " has format version ", version,
              "; this ampx reads version ", kShardVersion);
  TORCH_CHECK(f.integer("rank") == rank && f.integer("world_size") == saved_world, f.where(),
              " was written by rank ", f.integer("rank"), " of ", f.integer("world_size"),
              ", not rank ", rank, " of ", saved_world);
  const int64_t count = f.integer("num_params");
  TORCH_CHECK(count >= 0 && count <= static_cast<int64_t>(impl.params.size()), f.where(), " holds ",
              count, " parameters; the model has ", impl.params.size());
  for (int64_t k = 0; k < count; ++k) {
    const std::string name = f.text(key("param", k, "name"));
    const auto found = by_name.find(name);
    TORCH_CHECK(found != by_name.end(), f.where(), " holds parameter '", name,
                "', which this model has not");
    const auto& p = impl.params[found->second];
    const int64_t numel = f.integer(key("param", k, "numel"));
    TORCH_CHECK(numel == p.numel, f.where(), " holds parameter '", name, "' with ", numel,
                " elements; this model's has ", p.numel);
    const int64_t begin = f.integer(key("param", k, "begin"));
    at::Tensor value;
    TORCH_CHECK(f.try_tensor(key("param", k, "value"), value), f.where(), " has no piece of '",
                name, "'");
    TORCH_CHECK(value.scalar_type() == at::kFloat && value.dim() == 1 && begin >= 0 &&
                    value.numel() <= numel - begin,
                f.where(), ": its piece of '", name, "' (", value.scalar_type(), " ", value.sizes(),
                " from element ", begin, ") does not lie in the parameter's ", numel,
                " fp32 elements");
    auto& r = rebuilt[found->second];
    const int64_t from = std::max(begin, r.begin);
    const int64_t to = std::min(begin + value.numel(), r.begin + r.length);
    const bool trains = with_optimizer && p.tensor.requires_grad();
    if (trains) {  // checked on every saved piece, used where it overlaps this rank's
      TORCH_CHECK(f.has(key("param", k, "step")), f.where(), " has no optimizer state for '", name,
                  "'");
    }
    if (from >= to) continue;
    r.spans.emplace_back(from, to);
    r.value.narrow(0, from - r.begin, to - from).copy_(value.narrow(0, from - begin, to - from));
    if (!trains) continue;
    const int64_t step = f.integer(key("param", k, "step"));
    at::Tensor exp_avg, exp_avg_sq;
    const bool has_avg = f.try_tensor(key("param", k, "exp_avg"), exp_avg);
    const bool has_sq = f.try_tensor(key("param", k, "exp_avg_sq"), exp_avg_sq);
    if (r.step < 0) {
      r.step = step;
      r.has_exp_avg = has_avg;
      r.has_exp_avg_sq = has_sq;
      if (has_avg) r.exp_avg = torch::zeros({r.length}, torch::kFloat);
      if (has_sq) r.exp_avg_sq = torch::zeros({r.length}, torch::kFloat);
    }
    TORCH_CHECK(step == r.step && has_avg == r.has_exp_avg && has_sq == r.has_exp_avg_sq, f.where(),
                ": the optimizer state of '", name,
                "' disagrees with another saved piece of it (step ", step, " vs ", r.step, ")");
    if (has_avg) {
      const auto t = f.vector(key("param", k, "exp_avg"), value.numel());
      r.exp_avg.narrow(0, from - r.begin, to - from).copy_(t.narrow(0, from - begin, to - from));
    }
    if (has_sq) {
      const auto t = f.vector(key("param", k, "exp_avg_sq"), value.numel());
      r.exp_avg_sq.narrow(0, from - r.begin, to - from).copy_(t.narrow(0, from - begin, to - from));
    }
  }
  if (buffers.empty()) {  // every shard has them: take the first's
    const int64_t n = f.integer("num_buffers");
    for (int64_t j = 0; j < n; ++j) {
      at::Tensor t;
      TORCH_CHECK(f.try_tensor(key("buffer", j, "value"), t), f.where(), " has no buffer ", j);
      buffers[f.text(key("buffer", j, "name"))] = t;
    }
  }
  OptimizerHeader h;
  if (!with_optimizer) return h;
  TORCH_CHECK(f.has("optimizer.type"), f.where(),
              " was saved without optimizer state; load it without an optimizer");
  h.type = f.text("optimizer.type");
  h.seed = f.integer("optimizer.seed");
  const int64_t groups = f.integer("optimizer.num_groups");
  TORCH_CHECK(groups >= 0 && groups <= (1 << 20), f.where(), " has ", groups, " param groups");
  for (int64_t g = 0; g < groups; ++g) h.lrs.push_back(f.real(key("optimizer.group", g, "lr")));
  return h;
}

}  // namespace

void FullyShardedDataParallel::save_shard(torch::serialize::OutputArchive& archive,
                                          const torch::optim::Optimizer* optimizer) const {
  const char* who = "FullyShardedDataParallel::save_shard";
  const auto* opt = mixed_precision(optimizer, who);
  std::unordered_map<const c10::TensorImpl*, bool> in_optimizer;
  if (opt) {
    for (const auto& g : opt->param_groups()) {
      for (const auto& t : g.params()) in_optimizer[t.unsafeGetTensorImpl()] = true;
    }
  }
  const auto cpu_copy = [](const at::Tensor& t) { return t.detach().cpu().clone(); };
  archive.write("ampx_fsdp_shard_version", c10::IValue(kShardVersion));
  archive.write("rank", c10::IValue(impl_->group.rank()));
  archive.write("world_size", c10::IValue(impl_->group.world_size()));
  int64_t k = 0;
  for (const auto& p : impl_->params) {
    if (p.piece.numel() == 0) continue;
    archive.write(key("param", k, "name"), c10::IValue(p.name));
    archive.write(key("param", k, "numel"), c10::IValue(p.numel));
    archive.write(key("param", k, "begin"), c10::IValue(piece_begin(*impl_, p)));
    archive.write(key("param", k, "value"), cpu_copy(p.piece), /*is_buffer=*/true);
    if (opt && p.tensor.requires_grad()) {
      TORCH_CHECK(in_optimizer.count(p.piece.unsafeGetTensorImpl()), who, ": parameter '", p.name,
                  "' is not in the optimizer; build it over parameters()");
      archive.write(key("param", k, "step"), c10::IValue(opt->step_count(p.piece)));
      const auto exp_avg = opt->exp_avg(p.piece), exp_avg_sq = opt->exp_avg_sq(p.piece);
      if (exp_avg.defined()) {
        archive.write(key("param", k, "exp_avg"), cpu_copy(exp_avg), /*is_buffer=*/true);
      }
      if (exp_avg_sq.defined()) {
        archive.write(key("param", k, "exp_avg_sq"), cpu_copy(exp_avg_sq), /*is_buffer=*/true);
      }
    }
    ++k;
  }
  archive.write("num_params", c10::IValue(k));
  int64_t j = 0;
  for (const auto& b : impl_->model->named_buffers()) {
    archive.write(key("buffer", j, "name"), c10::IValue(b.key()));
    archive.write(key("buffer", j, "value"), cpu_copy(b.value()), /*is_buffer=*/true);
    ++j;
  }
  archive.write("num_buffers", c10::IValue(j));
  if (!opt) return;
  archive.write("optimizer.type", c10::IValue(std::string(opt->name())));
  int64_t seed_bits;
  std::memcpy(&seed_bits, &opt->config().seed, sizeof(seed_bits));
  archive.write("optimizer.seed", c10::IValue(seed_bits));
  const auto& groups = opt->param_groups();
  archive.write("optimizer.num_groups", c10::IValue(static_cast<int64_t>(groups.size())));
  for (size_t g = 0; g < groups.size(); ++g) {
    archive.write(key("optimizer.group", static_cast<int64_t>(g), "lr"),
                  c10::IValue(groups[g].options().get_lr()));
  }
}

void FullyShardedDataParallel::load_shards(int64_t saved_world_size, const ShardReader& read_shard,
                                           torch::optim::Optimizer* optimizer) {
  const char* who = "FullyShardedDataParallel::load_shards";
  auto& impl = *impl_;
  auto* opt = mixed_precision(optimizer, who);
  torch::NoGradGuard no_grad;
  std::string error;
  std::vector<Rebuilt> rebuilt(impl.params.size());
  std::map<std::string, at::Tensor> buffers;
  std::string backup;  // the optimizer's state before, restored if a rank fails
  bool optimizer_loaded = false;
  try {
    TORCH_CHECK(saved_world_size >= 1, who, ": saved_world_size must be >= 1, got ",
                saved_world_size);
    std::unordered_map<std::string, size_t> by_name;
    for (size_t i = 0; i < impl.params.size(); ++i) {
      const auto& p = impl.params[i];
      by_name[p.name] = i;
      rebuilt[i].length = p.piece.numel();
      rebuilt[i].begin = rebuilt[i].length > 0 ? piece_begin(impl, p) : 0;
      rebuilt[i].value = torch::empty({rebuilt[i].length}, torch::kFloat);
    }
    OptimizerHeader header;
    for (int64_t r = 0; r < saved_world_size; ++r) {
      torch::serialize::InputArchive archive;
      read_shard(r, archive);
      const auto h = read_shard_into(impl, archive, r, saved_world_size, opt != nullptr, by_name,
                                     rebuilt, buffers);
      TORCH_CHECK(r == 0 || h == header, who, ": saved rank ", r,
                  "'s optimizer settings (type, seed, learning rates) differ from rank 0's");
      header = h;
    }
    for (size_t i = 0; i < impl.params.size(); ++i) {  // every element from one saved piece
      auto& r = rebuilt[i];
      std::sort(r.spans.begin(), r.spans.end());
      int64_t at = r.begin;
      for (const auto& [from, to] : r.spans) {
        TORCH_CHECK(from == at, who, ": elements [", std::min(from, at), ", ", std::max(from, at),
                    ") of parameter '", impl.params[i].name, "' are ",
                    from > at ? "in no saved shard" : "in two saved shards");
        at = to;
      }
      TORCH_CHECK(at == r.begin + r.length, who, ": elements [", at, ", ", r.begin + r.length,
                  ") of parameter '", impl.params[i].name, "' are in no saved shard");
    }
    const auto model_buffers = impl.model->named_buffers();
    TORCH_CHECK(buffers.size() == model_buffers.size(), who, ": the saved shards hold ",
                buffers.size(), " buffers; the model has ", model_buffers.size());
    for (const auto& b : model_buffers) {
      const auto it = buffers.find(b.key());
      TORCH_CHECK(it != buffers.end(), who, ": the saved shards have no buffer '", b.key(), "'");
      TORCH_CHECK(it->second.scalar_type() == b.value().scalar_type() &&
                      it->second.sizes() == b.value().sizes(),
                  who, ": saved buffer '", b.key(), "' is ", it->second.scalar_type(), " ",
                  it->second.sizes(), "; the model's is ", b.value().scalar_type(), " ",
                  b.value().sizes());
    }
    if (opt) {
      TORCH_CHECK(header.type == opt->name(), who,
                  ": the saved optimizer state is ampx::optim::", header.type,
                  "'s; this optimizer is ampx::optim::", opt->name());
      const auto& groups = opt->param_groups();
      TORCH_CHECK(header.lrs.size() == groups.size(), who, ": the saved optimizer has ",
                  header.lrs.size(), " param groups; this one has ", groups.size());
      std::unordered_map<const c10::TensorImpl*, size_t> index_of;
      for (size_t i = 0; i < impl.params.size(); ++i) {
        index_of[impl.params[i].piece.unsafeGetTensorImpl()] = i;
      }
      torch::serialize::OutputArchive state;  // ampx::optim's position keys
      state.write("ampx_optim_version", c10::IValue(kOptimStateVersion));
      state.write("ampx_optim_type", c10::IValue(header.type));
      state.write("seed", c10::IValue(header.seed));
      state.write("num_groups", c10::IValue(static_cast<int64_t>(groups.size())));
      for (size_t g = 0; g < groups.size(); ++g) {
        const std::string prefix = "group" + std::to_string(g);
        state.write(prefix + ".num_params",
                    c10::IValue(static_cast<int64_t>(groups[g].params().size())));
        state.write(prefix + ".lr", c10::IValue(header.lrs[g]));
        for (size_t i = 0; i < groups[g].params().size(); ++i) {
          const auto found = index_of.find(groups[g].params()[i].unsafeGetTensorImpl());
          TORCH_CHECK(found != index_of.end(), who, ": the optimizer's param ", i, " of group ", g,
                      " is not one of parameters()");
          const auto& r = rebuilt[found->second];
          const std::string param = prefix + ".param" + std::to_string(i);
          state.write(param + ".step", c10::IValue(std::max<int64_t>(r.step, 0)));
          if (r.has_exp_avg) state.write(param + ".exp_avg", r.exp_avg, /*is_buffer=*/true);
          if (r.has_exp_avg_sq) {
            state.write(param + ".exp_avg_sq", r.exp_avg_sq, /*is_buffer=*/true);
          }
        }
      }
      torch::serialize::OutputArchive before;
      opt->save(before);
      std::ostringstream before_bytes, state_bytes;
      before.save_to(before_bytes);
      backup = before_bytes.str();
      state.save_to(state_bytes);
      std::istringstream in_bytes(state_bytes.str());
      torch::serialize::InputArchive in;
      in.load_from(in_bytes);
      opt->load(in);  // checks everything again; changes nothing if it throws
      optimizer_loaded = true;
    }
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  // Every rank commits, or none.
  const auto errors = impl.group.all_gather_bytes(error);
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty()) continue;
    if (optimizer_loaded) {
      std::istringstream in_bytes(backup);
      torch::serialize::InputArchive in;
      in.load_from(in_bytes);
      opt->load(in);
    }
    TORCH_CHECK(false, who, ": nothing was loaded: rank ", r, " failed: ", errors[r]);
  }
  for (size_t i = 0; i < impl.params.size(); ++i) {
    if (rebuilt[i].length > 0) impl.params[i].piece.copy_(rebuilt[i].value);
  }
  for (const auto& b : impl.model->named_buffers()) b.value().copy_(buffers.at(b.key()));
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
