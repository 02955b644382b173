// GradScaler state dicts: PyTorch's keys and value types, so a state saved by
// Python's torch.amp.GradScaler loads here and ours loads there.

#include "ampx/grad_scaler.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cmath>
#include <sstream>

namespace ampx {
namespace {

constexpr int64_t kStateVersion = 1;
// Every key ampx writes, in the order it writes them.
const char* const kKeys[] = {"scale",      "growth_factor",       "backoff_factor",
                             "growth_interval", "_growth_tracker", "hysteresis",
                             "_hysteresis_tracker", "min_scale", "max_scale",
                             "_ampx_state_version"};

std::string key_list(const StateDict& dict) {
  std::ostringstream out;
  const char* sep = "";
  for (const auto& entry : dict) {
    out << sep << entry.first;
    sep = ", ";
  }
  return out.str();
}

const c10::IValue& require(const StateDict& dict, const char* key) {
  const auto it = dict.find(key);
  TORCH_CHECK(it != dict.end(), "GradScaler.load_state_dict: missing key '", key,
              "' (the state dict has: ", key_list(dict), ")");
  return it->second;
}

double as_double(const c10::IValue& v, const char* key) {
  TORCH_CHECK(v.isDouble() || v.isInt(), "GradScaler.load_state_dict: '", key,
              "' must be a number, got ", v.tagKind());
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}

int64_t as_int(const c10::IValue& v, const char* key) {
  TORCH_CHECK(v.isInt(), "GradScaler.load_state_dict: '", key, "' must be an int, got ",
              v.tagKind());
  return v.toInt();
}

c10::optional<double> as_bound(const c10::IValue& v, const char* key) {
  if (v.isNone()) {
    return c10::nullopt;
  }
  const double x = as_double(v, key);
  TORCH_CHECK(x > 0.0, "GradScaler.load_state_dict: '", key, "' must be > 0 or None, got ", x);
  return x;
}

c10::IValue bound_value(const c10::optional<double>& b) {
  return b ? c10::IValue(*b) : c10::IValue();
}

}  // namespace

StateDict GradScaler::state_dict() const {
  StateDict dict;
  if (!enabled_) {
    return dict;
  }
  dict.emplace("scale", get_scale());
  dict.emplace("growth_factor", rule_.growth_factor);
  dict.emplace("backoff_factor", rule_.backoff_factor);
  dict.emplace("growth_interval", rule_.growth_interval);
  dict.emplace("_growth_tracker", get_growth_tracker());
  dict.emplace("hysteresis", rule_.hysteresis);
  dict.emplace("_hysteresis_tracker", get_hysteresis_tracker());
  dict.emplace("min_scale", bound_value(rule_.min_scale));
  dict.emplace("max_scale", bound_value(rule_.max_scale));
  dict.emplace("_ampx_state_version", kStateVersion);
  return dict;
}

void GradScaler::load_state_dict(const StateDict& state_dict) {
  if (!enabled_) {
    return;
  }
  TORCH_CHECK(state_dict.size() != 0,
              "The source state dict is empty, possibly because it was saved from a disabled "
              "instance of GradScaler.");
  // Parse and validate everything first: a bad dict changes nothing.
  if (state_dict.count("_ampx_state_version")) {
    const auto version = as_int(state_dict.at("_ampx_state_version"), "_ampx_state_version");
    TORCH_CHECK(version >= 1 && version <= kStateVersion,
                "GradScaler.load_state_dict: '_ampx_state_version' is ", version,
                " but this ampx reads versions 1 to ", kStateVersion,
                " (saved by a newer ampx?)");
  }
  const double scale = as_double(require(state_dict, "scale"), "scale");
  TORCH_CHECK(std::isfinite(scale) && scale > 0.0,
              "GradScaler.load_state_dict: 'scale' must be finite and > 0, got ", scale);
  ScaleUpdateRule rule = rule_;
  rule.growth_factor = as_double(require(state_dict, "growth_factor"), "growth_factor");
  rule.backoff_factor = as_double(require(state_dict, "backoff_factor"), "backoff_factor");
  rule.growth_interval = as_int(require(state_dict, "growth_interval"), "growth_interval");
  TORCH_CHECK(rule.growth_interval > 0,
              "GradScaler.load_state_dict: 'growth_interval' must be > 0, got ",
              rule.growth_interval);
  const int64_t growth_tracker =
      as_int(require(state_dict, "_growth_tracker"), "_growth_tracker");
  TORCH_CHECK(growth_tracker >= 0 && growth_tracker < rule.growth_interval,
              "GradScaler.load_state_dict: '_growth_tracker' must be in [0, growth_interval=",
              rule.growth_interval, "), got ", growth_tracker);
  if (state_dict.count("hysteresis")) {
    rule.hysteresis = as_int(state_dict.at("hysteresis"), "hysteresis");
    TORCH_CHECK(rule.hysteresis >= 1,
                "GradScaler.load_state_dict: 'hysteresis' must be >= 1, got ", rule.hysteresis);
  }
  int64_t hysteresis_tracker = get_hysteresis_tracker();
  if (state_dict.count("_hysteresis_tracker")) {
    hysteresis_tracker = as_int(state_dict.at("_hysteresis_tracker"), "_hysteresis_tracker");
  }
  TORCH_CHECK(hysteresis_tracker >= 0 && hysteresis_tracker <= rule.hysteresis,
              "GradScaler.load_state_dict: '_hysteresis_tracker' must be in [0, hysteresis=",
              rule.hysteresis, "], got ", hysteresis_tracker);
  if (state_dict.count("min_scale")) {
    rule.min_scale = as_bound(state_dict.at("min_scale"), "min_scale");
  }
  if (state_dict.count("max_scale")) {
    rule.max_scale = as_bound(state_dict.at("max_scale"), "max_scale");
  }

  rule_ = rule;
  init_scale_ = scale;
  init_growth_tracker_ = growth_tracker;
  init_hysteresis_tracker_ = hysteresis_tracker;
  if (scale_.defined()) {
    scale_.fill_(scale);
    growth_tracker_.fill_(growth_tracker);
    hysteresis_tracker_.fill_(hysteresis_tracker);
  }
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  const auto dict = state_dict();
  for (const char* key : kKeys) {
    const auto it = dict.find(key);
    if (it != dict.end() && !it->second.isNone()) {  // archives hold no None
      archive.write(std::string("grad_scaler.") + key, it->second);
    }
  }
  archive.write("grad_scaler.enabled", c10::IValue(enabled_));
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  c10::IValue enabled;
  TORCH_CHECK(archive.try_read("grad_scaler.enabled", enabled),
              "GradScaler::load: the archive holds no GradScaler state ('grad_scaler.enabled' "
              "is missing)");
  StateDict dict;
  for (const char* key : kKeys) {
    c10::IValue value;
    if (archive.try_read(std::string("grad_scaler.") + key, value)) {
      dict.emplace(key, value);
    } else if (std::string(key) == "min_scale" || std::string(key) == "max_scale") {
      dict.emplace(key, c10::IValue());  // absent bound = no bound
    }
  }
  if (!enabled.toBool()) {
    dict = StateDict();  // saved disabled: PyTorch's empty dict
  }
  load_state_dict(dict);
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const GradScaler& scaler) {
  scaler.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           GradScaler& scaler) {
  scaler.load(archive);
  return archive;
}

}  // namespace ampx
