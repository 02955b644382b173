// The sharded checkpoint's format (shard_pieces.h): writing a rank's pieces,
// reading every saved rank's into this rank's, and handing the optimizer
// state to ampx::optim's own load().

#include "shard_pieces.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <type_traits>
#include <unordered_map>

namespace ampx {
namespace dist {
namespace shard {

#if defined(AMPX_WITH_DIST)

namespace {

constexpr int64_t kShardVersion = 2;       // reads 1 (fp32 moments only) too
constexpr int64_t kOptimStateVersion = 2;  // src/optim/optimizer_state.cpp's

template <typename Optimizer>
auto* checked(Optimizer* o, const char* who) {
  using Mixed =
      std::conditional_t<std::is_const_v<Optimizer>, const ampx::optim::MixedPrecisionOptimizer,
                         ampx::optim::MixedPrecisionOptimizer>;
  if (o == nullptr) return static_cast<Mixed*>(nullptr);
  auto* mixed = dynamic_cast<Mixed*>(o);
  TORCH_CHECK(mixed != nullptr, who,
              ": optimizer must be one of ampx::optim's (AdamW, SGD, LAMB), whose state is saved "
              "by parameter; got another torch::optim::Optimizer");
  return mixed;
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
                "' (not a sharded checkpoint's shard, or a damaged one)");
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
  /// Bytes kept as a 1-D uint8 tensor.
  std::string bytes(const std::string& k) const {
    at::Tensor t;
    TORCH_CHECK(try_tensor(k, t) && t.scalar_type() == at::kByte && t.dim() == 1, where_,
                " has no bytes '", k, "'");
    const auto c = t.contiguous();
    return std::string(reinterpret_cast<const char*>(c.data_ptr<uint8_t>()),
                       static_cast<size_t>(c.numel()));
  }
  const std::string& where() const { return where_; }

 private:
  torch::serialize::InputArchive& archive_;
  std::string where_;
};

/// Copies elements [from, to) of the parameter from a saved piece starting at `begin`.
void fill(at::Tensor& into, int64_t into_begin, const at::Tensor& saved, int64_t begin,
          int64_t from, int64_t to) {
  into.narrow(0, from - into_begin, to - from).copy_(saved.narrow(0, from - begin, to - from));
}

/// The optimizer state of saved piece `k` (of `length` elements) into `r`,
/// where it overlaps [from, to).
void read_piece_state(const ShardFields& f, int64_t k, const std::string& name, int64_t begin,
                      int64_t length, int64_t from, int64_t to, const PieceTarget& t, Rebuilt& r) {
  const int64_t step = f.integer(key("param", k, "step"));
  at::Tensor exp_avg, exp_avg_sq;
  const bool has_avg = f.try_tensor(key("param", k, "exp_avg"), exp_avg);
  const bool has_sq = f.try_tensor(key("param", k, "exp_avg_sq"), exp_avg_sq);
  if (r.step < 0) {
    r.step = step;
    r.has_exp_avg = has_avg;
    r.has_exp_avg_sq = has_sq;
    if (has_avg) r.exp_avg = torch::zeros({t.length}, torch::kFloat);
    if (has_sq) r.exp_avg_sq = torch::zeros({t.length}, torch::kFloat);
  }
  TORCH_CHECK(step == r.step && has_avg == r.has_exp_avg && has_sq == r.has_exp_avg_sq, f.where(),
              ": the optimizer state of '", name,
              "' disagrees with another saved piece of it (step ", step, " vs ", r.step, ")");
  if (has_avg)
    fill(r.exp_avg, t.begin, f.vector(key("param", k, "exp_avg"), length), begin, from, to);
  if (has_sq) {
    fill(r.exp_avg_sq, t.begin, f.vector(key("param", k, "exp_avg_sq"), length), begin, from, to);
  }
}

/// Reads saved rank `rank`'s shard into `loaded`; returns its optimizer header.
OptimizerHeader read_one(torch::serialize::InputArchive& archive, int64_t rank, int64_t saved_world,
                         bool with_optimizer, const std::vector<PieceTarget>& targets,
                         const std::unordered_map<std::string, size_t>& by_name,
                         const Reader& reader, Loaded& loaded) {
  const ShardFields f(archive, rank);
  const int64_t version = f.integer("ampx_fsdp_shard_version");
  TORCH_CHECK(version == 1 || version == kShardVersion, f.where(), " has format version ", version,
              "; this ampx reads versions 1 and ", kShardVersion);
  TORCH_CHECK(f.integer("rank") == rank && f.integer("world_size") == saved_world, f.where(),
              " was written by rank ", f.integer("rank"), " of ", f.integer("world_size"),
              ", not rank ", rank, " of ", saved_world);
  const int64_t count = f.integer("num_params");
  TORCH_CHECK(count >= 0 && count <= static_cast<int64_t>(targets.size()), f.where(), " holds ",
              count, " parameters; the model has ", targets.size());
  for (int64_t k = 0; k < count; ++k) {
    const std::string name = f.text(key("param", k, "name"));
    const auto found = by_name.find(name);
    TORCH_CHECK(found != by_name.end(), f.where(), " holds parameter '", name,
                "', which this model has not");
    const auto& t = targets[found->second];
    const int64_t numel = f.integer(key("param", k, "numel"));
    TORCH_CHECK(numel == t.numel, f.where(), " holds parameter '", name, "' with ", numel,
                " elements; this model's has ", t.numel);
    const int64_t begin = f.integer(key("param", k, "begin"));
    at::Tensor value;
    TORCH_CHECK(f.try_tensor(key("param", k, "value"), value), f.where(), " has no piece of '",
                name, "'");
    TORCH_CHECK(value.scalar_type() == at::kFloat && value.dim() == 1 && begin >= 0 &&
                    value.numel() <= numel - begin,
                f.where(), ": its piece of '", name, "' (", value.scalar_type(), " ", value.sizes(),
                " from element ", begin, ") does not lie in the parameter's ", numel,
                " fp32 elements");
    auto& r = loaded.pieces[found->second];
    const int64_t from = std::max(begin, t.begin);
    const int64_t to = std::min(begin + value.numel(), t.begin + t.length);
    const bool trains = with_optimizer && t.trains;
    if (trains) {  // checked on every saved piece, used where it overlaps this rank's
      TORCH_CHECK(f.has(key("param", k, "step")), f.where(), " has no optimizer state for '", name,
                  "'");
    }
    if (from >= to) continue;
    r.spans.emplace_back(from, to);
    fill(r.value, t.begin, value, begin, from, to);
    if (trains) read_piece_state(f, k, name, begin, value.numel(), from, to, t, r);
  }
  if (loaded.buffers.empty()) {  // every shard has them: take the first's
    const int64_t n = f.integer("num_buffers");
    for (int64_t j = 0; j < n; ++j) {
      at::Tensor b;
      TORCH_CHECK(f.try_tensor(key("buffer", j, "value"), b), f.where(), " has no buffer ", j);
      loaded.buffers[f.text(key("buffer", j, "name"))] = b;
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
  if (version < 2) return h;  // fp32 moments, no Kahan
  h.state_format = f.text("optimizer.state_format");
  h.state_block = f.integer("optimizer.state_block");
  h.kahan_summation = f.integer("optimizer.kahan_summation") != 0;
  if (h.state_format != "fp32" && rank == reader.rank && saved_world == reader.world &&
      f.text("optimizer.layout") == reader.layout) {
    loaded.same_layout_state = f.bytes("optimizer.local");
  }
  return h;
}

/// Every element of every target from exactly one saved piece.
void check_covered(const char* who, const std::vector<PieceTarget>& targets, Loaded& loaded) {
  for (size_t i = 0; i < targets.size(); ++i) {
    auto& r = loaded.pieces[i];
    const auto& t = targets[i];
    std::sort(r.spans.begin(), r.spans.end());
    int64_t at = t.begin;
    for (const auto& [from, to] : r.spans) {
      TORCH_CHECK(from == at, who, ": elements [", std::min(from, at), ", ", std::max(from, at),
                  ") of parameter '", t.name, "' are ",
                  from > at ? "in no saved shard" : "in two saved shards");
      at = to;
    }
    TORCH_CHECK(at == t.begin + t.length, who, ": elements [", at, ", ", t.begin + t.length,
                ") of parameter '", t.name, "' are in no saved shard");
  }
}

void check_buffers(const char* who, const std::map<std::string, at::Tensor>& saved,
                   const std::vector<std::pair<std::string, at::Tensor>>& model_buffers) {
  TORCH_CHECK(saved.size() == model_buffers.size(), who, ": the saved shards hold ", saved.size(),
              " buffers; the model has ", model_buffers.size());
  for (const auto& [name, b] : model_buffers) {
    const auto it = saved.find(name);
    TORCH_CHECK(it != saved.end(), who, ": the saved shards have no buffer '", name, "'");
    TORCH_CHECK(it->second.scalar_type() == b.scalar_type() && it->second.sizes() == b.sizes(), who,
                ": saved buffer '", name, "' is ", it->second.scalar_type(), " ",
                it->second.sizes(), "; the model's is ", b.scalar_type(), " ", b.sizes());
  }
}

}  // namespace

const ampx::optim::MixedPrecisionOptimizer* checkpointable(const torch::optim::Optimizer* o,
                                                           const char* who) {
  return checked(o, who);
}

ampx::optim::MixedPrecisionOptimizer* checkpointable(torch::optim::Optimizer* o, const char* who) {
  return checked(o, who);
}

void write_shard(torch::serialize::OutputArchive& archive, int64_t rank, int64_t world,
                 const std::vector<SavedPiece>& pieces,
                 const std::vector<std::pair<std::string, at::Tensor>>& buffers,
                 const ampx::optim::MixedPrecisionOptimizer* optimizer, const std::string& layout) {
  const auto cpu_copy = [](const at::Tensor& t) { return t.detach().cpu().clone(); };
  archive.write("ampx_fsdp_shard_version", c10::IValue(kShardVersion));
  archive.write("rank", c10::IValue(rank));
  archive.write("world_size", c10::IValue(world));
  int64_t k = 0;
  for (const auto& p : pieces) {
    archive.write(key("param", k, "name"), c10::IValue(p.name));
    archive.write(key("param", k, "numel"), c10::IValue(p.numel));
    archive.write(key("param", k, "begin"), c10::IValue(p.begin));
    archive.write(key("param", k, "value"), cpu_copy(p.value), /*is_buffer=*/true);
    if (optimizer && p.trains) {
      archive.write(key("param", k, "step"), c10::IValue(p.step));
      if (p.exp_avg.defined()) {
        archive.write(key("param", k, "exp_avg"), cpu_copy(p.exp_avg), /*is_buffer=*/true);
      }
      if (p.exp_avg_sq.defined()) {
        archive.write(key("param", k, "exp_avg_sq"), cpu_copy(p.exp_avg_sq), /*is_buffer=*/true);
      }
    }
    ++k;
  }
  archive.write("num_params", c10::IValue(k));
  int64_t j = 0;
  for (const auto& [name, b] : buffers) {
    archive.write(key("buffer", j, "name"), c10::IValue(name));
    archive.write(key("buffer", j, "value"), cpu_copy(b), /*is_buffer=*/true);
    ++j;
  }
  archive.write("num_buffers", c10::IValue(j));
  if (!optimizer) return;
  archive.write("optimizer.type", c10::IValue(std::string(optimizer->name())));
  int64_t seed_bits;
  std::memcpy(&seed_bits, &optimizer->config().seed, sizeof(seed_bits));
  archive.write("optimizer.seed", c10::IValue(seed_bits));
  const auto& groups = optimizer->param_groups();
  archive.write("optimizer.num_groups", c10::IValue(static_cast<int64_t>(groups.size())));
  for (size_t g = 0; g < groups.size(); ++g) {
    archive.write(key("optimizer.group", static_cast<int64_t>(g), "lr"),
                  c10::IValue(groups[g].options().get_lr()));
  }
  const auto& c = optimizer->config();
  archive.write("optimizer.state_format",
                c10::IValue(std::string(ampx::optim::state_format_name(c.state_format))));
  archive.write("optimizer.state_block", c10::IValue(c.state_block));
  archive.write("optimizer.kahan_summation", c10::IValue(static_cast<int64_t>(c.kahan_summation)));
  if (c.state_format == ampx::optim::StateFormat::kFp32) return;  // the pieces are the state
  const std::string bytes = optimizer_bytes(*optimizer);
  auto local = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kByte);
  std::memcpy(local.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  archive.write("optimizer.layout", c10::IValue(layout));
  archive.write("optimizer.local", local, /*is_buffer=*/true);
}

Loaded read_shards(const char* who, int64_t saved_world, const ShardReader& read,
                   const std::vector<PieceTarget>& targets, bool with_optimizer,
                   const std::vector<std::pair<std::string, at::Tensor>>& model_buffers,
                   const Reader& reader) {
  TORCH_CHECK(saved_world >= 1, who, ": saved_world_size must be >= 1, got ", saved_world);
  Loaded loaded;
  std::unordered_map<std::string, size_t> by_name;
  loaded.pieces.resize(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    by_name[targets[i].name] = i;
    loaded.pieces[i].value = torch::empty({targets[i].length}, torch::kFloat);
  }
  for (int64_t r = 0; r < saved_world; ++r) {
    torch::serialize::InputArchive archive;
    read(r, archive);
    const auto h =
        read_one(archive, r, saved_world, with_optimizer, targets, by_name, reader, loaded);
    TORCH_CHECK(r == 0 || h == loaded.optimizer, who, ": saved rank ", r,
                "'s optimizer settings (type, seed, learning rates, state format) differ from "
                "rank 0's");
    loaded.optimizer = h;
  }
  check_covered(who, targets, loaded);
  check_buffers(who, loaded.buffers, model_buffers);
  return loaded;
}

void load_optimizer(const char* who, ampx::optim::MixedPrecisionOptimizer& optimizer,
                    const Loaded& loaded,
                    const std::function<OptimizerSlot(size_t group, size_t param)>& fill_slot) {
  const auto& header = loaded.optimizer;
  TORCH_CHECK(header.type == optimizer.name(), who,
              ": the saved optimizer state is ampx::optim::", header.type,
              "'s; this optimizer is ampx::optim::", optimizer.name());
  const auto& config = optimizer.config();
  const std::string format = ampx::optim::state_format_name(config.state_format);
  TORCH_CHECK(header.state_format == format, who, ": the saved shards keep ", header.state_format,
              " moments; this optimizer has state_format ", format);
  if (!loaded.same_layout_state.empty()) {  // the same pieces in the same places: as saved
    restore_optimizer(optimizer, loaded.same_layout_state);
    return;
  }
  const auto& groups = optimizer.param_groups();
  TORCH_CHECK(header.lrs.size() == groups.size(), who, ": the saved optimizer has ",
              header.lrs.size(), " param groups; this one has ", groups.size());
  torch::serialize::OutputArchive state;  // ampx::optim's position keys
  state.write("ampx_optim_version", c10::IValue(kOptimStateVersion));
  state.write("ampx_optim_type", c10::IValue(header.type));
  state.write("seed", c10::IValue(header.seed));
  state.write("num_groups", c10::IValue(static_cast<int64_t>(groups.size())));
  state.write("state_format", c10::IValue(header.state_format));
  // (version 1 shards: fp32 moments, whose block the optimizer does not read)
  state.write("state_block",
              c10::IValue(header.state_block > 0 ? header.state_block : config.state_block));
  state.write("kahan_summation", c10::IValue(static_cast<int64_t>(header.kahan_summation)));
  uint64_t seed;
  std::memcpy(&seed, &header.seed, sizeof(seed));
  int64_t position = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string prefix = "group" + std::to_string(g);
    state.write(prefix + ".num_params",
                c10::IValue(static_cast<int64_t>(groups[g].params().size())));
    state.write(prefix + ".lr", c10::IValue(header.lrs[g]));
    for (size_t i = 0; i < groups[g].params().size(); ++i, ++position) {
      const OptimizerSlot slot = fill_slot(g, i);
      const std::string param = prefix + ".param" + std::to_string(i);
      state.write(param + ".step", c10::IValue(slot.step));
      // The moments encoded in this rank's blocks (bf16: rounded
      // stochastically, a stream of its own per parameter position).
      const uint64_t key = seed ^ (0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(position + 1));
      const std::pair<const char*, const at::Tensor*> moments[] = {
          {"exp_avg", &slot.exp_avg}, {"exp_avg_sq", &slot.exp_avg_sq}};
      for (const auto& [name, values] : moments) {
        if (!values->defined()) continue;
        const auto coded =
            ampx::optim::coded_moment(config, values->cpu(), name == moments[0].first, key);
        state.write(param + "." + name, coded.values, true);
        if (coded.scale.defined()) state.write(param + "." + name + "_scale", coded.scale, true);
      }
    }
  }
  std::ostringstream bytes;
  state.save_to(bytes);
  restore_optimizer(optimizer,
                    bytes.str());  // checks everything again; changes nothing if it throws
}

std::vector<std::pair<std::string, at::Tensor>> buffers_of(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& b : model.named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

void commit_everywhere(const char* who, const ProcessGroup& group, const std::string& error,
                       const std::function<void()>& roll_back) {
  const auto errors = group.all_gather_bytes(error);
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty()) continue;
    roll_back();
    TORCH_CHECK(false, who, ": nothing was loaded: rank ", r, " failed: ", errors[r]);
  }
}

void check_export_dtype(const char* who, c10::ScalarType dtype) {
  TORCH_CHECK(dtype == c10::kFloat || dtype == c10::kBFloat16 || dtype == c10::kHalf, who,
              ": dtype is ", dtype, "; the parameters are written in Float, BFloat16 or Half");
}

void throw_rank0_error(const char* who, const ProcessGroup& group, const std::string& error) {
  const auto errors = group.all_gather_bytes(error);
  TORCH_CHECK(errors.front().empty(), who, ": rank 0 failed: ", errors.front());
}

std::string optimizer_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  return bytes.str();
}

void restore_optimizer(torch::optim::Optimizer& optimizer, const std::string& bytes) {
  std::istringstream in_bytes(bytes);
  torch::serialize::InputArchive in;
  in.load_from(in_bytes);
  optimizer.load(in);
}

#endif  // AMPX_WITH_DIST

}  // namespace shard
}  // namespace dist
}  // namespace ampx
