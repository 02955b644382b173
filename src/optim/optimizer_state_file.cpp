// MixedPrecisionOptimizer::state_tensors / load_state_tensors and the
// safetensors file of them (ampx/optim/state_file.h has the layout): the
// state as named tensors, its moments as they are kept, which Python reads
// and torchao's low-bit optimizers share (tools/optim_state_torchao.py).

#include "ampx/optim/state_file.h"

#include "ampx/safetensors.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <array>
#include <cstdint>
#include <exception>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fused/state_codes.h"

namespace ampx {
namespace optim {
namespace {

constexpr const char* kFormat = "ampx.optimizer_state";
constexpr const char* kFormatVersion = "1";
const char* const kMoments[2] = {"exp_avg", "exp_avg_sq"};
// A param's entries, the longest first (an entry is "<param name>.<suffix>").
const std::array<const char*, 7> kSuffixes = {
    "exp_avg_sq.scale", "exp_avg.scale", "compensation", "exp_avg_sq", "exp_avg", "master", "step"};
const char* const kMapNames[2] = {"ampx.map_signed", "ampx.map_unsigned"};

at::Tensor map_tensor(bool is_signed) {
  const auto& map = ::ampx::detail::math::dynamic_map(is_signed);
  return at::from_blob(const_cast<float*>(map.value), {256}, at::kFloat).clone();
}

std::string meta(const OptimizerStateTensors& state, const std::string& key,
                 const std::string& who) {
  const auto it = state.metadata.find(key);
  TORCH_CHECK(it != state.metadata.end(), who, ": the state's metadata has no '", key,
              "' (not an ampx optimizer state, or a corrupt one)");
  return it->second;
}

int64_t meta_int(const OptimizerStateTensors& state, const std::string& key,
                 const std::string& who) {
  const std::string text = meta(state, key, who);
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == text.size() && !text.empty(), who, ": metadata '", key, "' is '", text,
              "', not an integer");
  return v;
}

/// Splits `key` into the name of one of `names` and its suffix (kSuffixes).
std::pair<std::string, std::string> split_entry(
    const std::string& key, const std::unordered_map<std::string, size_t>& names) {
  for (const char* suffix : kSuffixes) {
    const std::string tail = std::string(".") + suffix;
    if (key.size() > tail.size() && key.compare(key.size() - tail.size(), tail.size(), tail) == 0) {
      std::string name = key.substr(0, key.size() - tail.size());
      if (names.count(name) != 0) return {std::move(name), suffix};
    }
  }
  return {};
}

}  // namespace

OptimizerStateTensors MixedPrecisionOptimizer::state_tensors(
    const std::vector<std::string>& names) const {
  const std::string who = std::string("ampx::optim::") + name() + "::state_tensors";
  size_t total = 0;
  for (const auto& group : param_groups_) total += group.params().size();
  TORCH_CHECK(names.size() == total, who, ": ", names.size(), " names for ", total, " params");
  OptimizerStateTensors out;
  out.metadata = {{"format", kFormat},
                  {"format_version", kFormatVersion},
                  {"optimizer", name()},
                  {"state_format", state_format_name(config_.state_format)},
                  {"state_block", std::to_string(config_.state_block)},
                  {"kahan_summation", config_.kahan_summation ? "1" : "0"},
                  {"seed", std::to_string(config_.seed)}};
  const auto put = [&](const std::string& key, const at::Tensor& t) {
    if (!t.defined()) return;
    TORCH_CHECK(out.tensors.emplace(key, t.detach().cpu().contiguous()).second, who, ": entry '",
                key, "' is named twice (two params named alike)");
  };
  if (config_.state_format == StateFormat::kInt8) {
    for (const int m : {0, 1}) put(kMapNames[m], map_tensor(m == 0));
  }
  size_t k = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (size_t i = 0; i < param_groups_[g].params().size(); ++i) {
      const std::string& n = names[k++];
      if (g >= states_.size() || i >= states_[g].size()) continue;
      const auto& st = states_[g][i];
      const int64_t step =
          st.step_t.defined() ? static_cast<int64_t>(st.step_t.item<double>()) : st.step;
      const bool any = step > 0 || st.exp_avg.defined() || st.exp_avg_sq.defined() ||
                       st.master.defined() || st.captured.defined() || st.compensation.defined();
      if (!any) continue;
      put(n + ".step", at::scalar_tensor(step, at::kLong));
      put(n + ".exp_avg", st.exp_avg);
      put(n + ".exp_avg.scale", st.exp_avg_scale);
      put(n + ".exp_avg_sq", st.exp_avg_sq);
      put(n + ".exp_avg_sq.scale", st.exp_avg_sq_scale);
      put(n + ".master", st.master.defined() ? st.master : st.captured);  // captured: the next
      put(n + ".compensation", st.compensation);                          // step's master
    }
  }
  return out;
}

namespace detail {

struct StateFileParam {
  std::string who;          // the loader, for errors
  std::string file_format;  // the file's state_format
  int64_t file_block = 0;   // and state_block
  std::string name;         // the param's
  size_t group = 0, position = 0;
  at::Tensor param;
  std::map<std::string, at::Tensor> entries;  // by suffix (kSuffixes)

  const at::Tensor* entry(const std::string& suffix) const {
    const auto it = entries.find(suffix);
    return it == entries.end() ? nullptr : &it->second;
  }
  void check_shape(const at::Tensor& t, at::IntArrayRef shape, const std::string& key) const {
    TORCH_CHECK(t.sizes() == shape, who, ": ", key, " has shape ", t.sizes(), ", expected ", shape);
  }
};

}  // namespace detail

namespace {

/// The file's state_format and state_block, checked, and its seed (or `seed`).
struct FileFormat {
  std::string format;
  int64_t block = 0;
  uint64_t seed = 0;
};

FileFormat read_file_format(const OptimizerStateTensors& state, const char* optimizer,
                            uint64_t seed, const std::string& who) {
  TORCH_CHECK(meta(state, "format", who) == kFormat, who, ": format '", meta(state, "format", who),
              "' is not '", kFormat, "'");
  TORCH_CHECK(meta(state, "format_version", who) == kFormatVersion, who, ": format_version '",
              meta(state, "format_version", who), "' is not supported (this build reads ",
              kFormatVersion, ")");
  TORCH_CHECK(meta(state, "optimizer", who) == optimizer, who, ": the state is of ",
              meta(state, "optimizer", who), ", this optimizer is ", optimizer);
  FileFormat f;
  f.format = meta(state, "state_format", who);
  (void)state_format_from_name(f.format);  // throws naming an unknown one
  f.block = meta_int(state, "state_block", who);
  f.seed = seed;
  if (state.metadata.count("seed") != 0) {
    const std::string text = meta(state, "seed", who);
    size_t used = 0;
    try {
      f.seed = std::stoull(text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TORCH_CHECK(used == text.size() && !text.empty() && text[0] != '-', who,
                ": metadata 'seed' is '", text, "', not an unsigned integer");
  }
  return f;
}

}  // namespace

void MixedPrecisionOptimizer::read_moment_entry(const detail::StateFileParam& file, int m,
                                                detail::ParamState& st) const {
  const std::string& who = file.who;
  const std::string moment = kMoments[m];
  const at::Tensor* t = file.entry(moment);
  const at::Tensor* scale = file.entry(moment + ".scale");
  const std::string key = file.name + "." + moment;
  if (t == nullptr) {
    TORCH_CHECK(scale == nullptr, who, ": ", key, ".scale without ", key);
    return;
  }
  const bool used = m == 0 ? uses_exp_avg(param_groups_[file.group].options()) : uses_exp_avg_sq();
  TORCH_CHECK(used, who, ": ", key, " is a moment ", name(), " does not keep here");
  file.check_shape(*t, file.param.sizes(), key);
  at::Tensor& values = m == 0 ? st.exp_avg : st.exp_avg_sq;
  at::Tensor& scales = m == 0 ? st.exp_avg_scale : st.exp_avg_sq_scale;
  const auto type = t->scalar_type();
  if (type == at::kFloat) {  // values: into this optimizer's format
    TORCH_CHECK(scale == nullptr, who, ": ", key, " is float32 values and has a .scale");
    const auto coded = coded_moment(config_, t->contiguous(), m == 0,
                                    config_.seed + 2 * static_cast<uint64_t>(file.position) + m);
    values = coded.values;
    scales = coded.scale;
    return;
  }
  TORCH_CHECK(type == at::kBFloat16 || type == at::kByte, who, ": ", key, " is ", type,
              "; a moment is float32, bfloat16 or uint8 codes");
  const char* kind = type == at::kByte ? "codes" : "bfloat16 values";
  const std::string this_format = state_format_name(config_.state_format);
  TORCH_CHECK(file.file_format == this_format, who, ": ", key, " is ", kind, " of state_format ",
              file.file_format, ", this optimizer has state_format ", this_format);
  TORCH_CHECK(coded_moments(file.param), who, ": ", key, " is ", kind,
              ", but this optimizer keeps ", file.name, "'s moments in float32 (",
              file.param.numel(), " elements, state_min_numel ", config_.state_min_numel, ")");
  TORCH_CHECK((type == at::kBFloat16) == (config_.state_format == StateFormat::kBf16), who, ": ",
              key, " is ", type, ", state_format ", this_format, " keeps ",
              config_.state_format == StateFormat::kBf16 ? "bfloat16" : "uint8 codes");
  values = t->contiguous().clone();
  if (type == at::kBFloat16) {
    TORCH_CHECK(scale == nullptr, who, ": ", key, " is bfloat16 values and has a .scale");
    return;
  }
  TORCH_CHECK(file.file_block == config_.state_block, who, ": ", key, " is codes of state_block ",
              file.file_block, ", this optimizer has state_block ", config_.state_block);
  TORCH_CHECK(scale != nullptr, who, ": ", key, " is codes without ", key, ".scale");
  const int64_t blocks = (file.param.numel() + config_.state_block - 1) / config_.state_block;
  TORCH_CHECK(scale->scalar_type() == at::kFloat, who, ": ", key, ".scale is ",
              scale->scalar_type(), ", expected Float");
  file.check_shape(*scale, {blocks}, key + ".scale");
  TORCH_CHECK(at::isfinite(*scale).all().item<bool>() && scale->ge(0).all().item<bool>(), who, ": ",
              key, ".scale has a negative or non-finite scale");
  scales = scale->contiguous().clone();
}

detail::ParamState MixedPrecisionOptimizer::read_state_entries(
    const detail::StateFileParam& file) const {
  const std::string& who = file.who;
  const std::string& n = file.name;
  const at::Tensor& param = file.param;
  const at::Tensor* step = file.entry("step");
  TORCH_CHECK(step != nullptr, who, ": ", n, " has state but no '", n, ".step'");
  TORCH_CHECK(step->numel() == 1 && !at::isFloatingType(step->scalar_type()) &&
                  step->scalar_type() != at::kBool,
              who, ": ", n, ".step must be one integer, got ", step->scalar_type(), " ",
              step->sizes());
  detail::ParamState st;
  st.step = step->item<int64_t>();
  TORCH_CHECK(st.step >= 0, who, ": ", n, ".step is ", st.step, ", must be >= 0");
  for (const int m : {0, 1}) read_moment_entry(file, m, st);
  TORCH_CHECK(
      !(uses_exp_avg_sq() && st.step > 0) || (st.exp_avg.defined() && st.exp_avg_sq.defined()), who,
      ": ", n, " has taken ", st.step, " steps but lacks ",
      st.exp_avg.defined() ? "exp_avg_sq" : "exp_avg");
  if (const at::Tensor* master = file.entry("master")) {
    TORCH_CHECK(param.scalar_type() != at::kFloat, who, ": ", n,
                ".master: a float32 param is its own master");
    TORCH_CHECK(config_.master_weights, who, ": ", n,
                ".master: this optimizer has master_weights(false)");
    TORCH_CHECK(master->scalar_type() == at::kFloat, who, ": ", n, ".master is ",
                master->scalar_type(), ", expected Float");
    file.check_shape(*master, param.sizes(), n + ".master");
    (st.step > 0 ? st.master : st.captured) = master->contiguous().clone();
  }
  if (const at::Tensor* comp = file.entry("compensation")) {
    TORCH_CHECK(kahan(param), who, ": ", n, ".compensation: this param keeps none");
    TORCH_CHECK(comp->scalar_type() == param.scalar_type(), who, ": ", n, ".compensation is ",
                comp->scalar_type(), ", expected ", param.scalar_type());
    file.check_shape(*comp, param.sizes(), n + ".compensation");
    st.compensation = comp->contiguous().clone();
  }
  for (at::Tensor* t : {&st.master, &st.captured, &st.exp_avg, &st.exp_avg_sq, &st.exp_avg_scale,
                        &st.exp_avg_sq_scale, &st.compensation}) {
    if (t->defined()) *t = t->to(param.device());
  }
  return st;
}

void MixedPrecisionOptimizer::load_state_tensors(const OptimizerStateTensors& state,
                                                 const std::vector<std::string>& names) {
  const std::string who = std::string("ampx::optim::") + name() + "::load_state_tensors";
  const FileFormat format = read_file_format(state, name(), config_.seed, who);
  std::vector<detail::StateFileParam> files;  // one per param, in group order
  std::unordered_map<std::string, size_t> position;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (const auto& param : param_groups_[g].params()) {
      detail::StateFileParam f;
      f.who = who;
      f.file_format = format.format;
      f.file_block = format.block;
      f.group = g;
      f.position = files.size();
      f.param = param;
      files.push_back(std::move(f));
    }
  }
  TORCH_CHECK(names.size() == files.size(), who, ": ", names.size(), " names for ", files.size(),
              " params");
  for (size_t k = 0; k < names.size(); ++k) {
    TORCH_CHECK(position.emplace(names[k], k).second, who, ": two params are named '", names[k],
                "'");
    files[k].name = names[k];
  }
  // Every entry is a param's or a map; a param's, by suffix.
  for (const auto& [key, t] : state.tensors) {
    if (key == kMapNames[0] || key == kMapNames[1]) continue;
    const auto [param_name, suffix] = split_entry(key, position);
    TORCH_CHECK(!param_name.empty(), who, ": entry '", key,
                "' is of no param of this optimizer (names: model.named_parameters())");
    files[position.at(param_name)].entries[suffix] = t;
  }
  std::vector<std::vector<detail::ParamState>> loaded(param_groups_.size());
  for (const auto& f : files) {
    // A param without entries has no state: it starts at its next step.
    loaded[f.group].push_back(f.entries.empty() ? detail::ParamState() : read_state_entries(f));
  }
  // Everything checked: commit.
  states_ = std::move(loaded);
  config_.seed = format.seed;
}

std::vector<std::string> param_names(const MixedPrecisionOptimizer& optimizer,
                                     const torch::nn::Module& model) {
  std::unordered_map<const c10::TensorImpl*, std::string> by_tensor;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    by_tensor.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  std::vector<std::string> names;
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      const auto it = by_tensor.find(groups[g].params()[i].unsafeGetTensorImpl());
      TORCH_CHECK(it != by_tensor.end(), "ampx::optim::param_names: param (group ", g, ", index ",
                  i, ") of ampx::optim::", optimizer.name(), " is not a parameter of the model");
      names.push_back(it->second);
    }
  }
  return names;
}

void save_optimizer_safetensors(const MixedPrecisionOptimizer& optimizer,
                                const torch::nn::Module& model, const std::string& path) {
  const auto state = optimizer.state_tensors(param_names(optimizer, model));
  save_safetensors(state.tensors, path, state.metadata);
}

void load_optimizer_safetensors(MixedPrecisionOptimizer& optimizer, const torch::nn::Module& model,
                                const std::string& path) {
  const auto names = param_names(optimizer, model);
  OptimizerStateTensors state;
  state.tensors = read_safetensors(path, &state.metadata);
  try {
    optimizer.load_state_tensors(state, names);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, ": ", e.what_without_backtrace());
  }
}

}  // namespace optim
}  // namespace ampx
