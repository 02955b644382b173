// Plans as JSON files: keys in a fixed order, one per line (diffable), read
// back with errors that name the file, the key and the value.

#include "ampx/precision_plan.h"

#include "../files/atomic_file.h"
#include "../files/json/reader.h"
#include "../files/json/writer.h"
#include "linears.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <sstream>

namespace ampx {
namespace plan {
namespace {

// 2: "reference" (version 1 has none: bf16), fp32 and fp16 layers. 3:
// "tail" (versions 1 and 2 have none: 0). 4: "floors" (versions 1 to 3 have
// none). A plan an older version can hold is written as that version, which
// older ampx reads.
constexpr int64_t kPlanVersion = 4;
using ampx::detail::json_number;
using ampx::detail::json_string;
using ampx::detail::JsonValue;
using ampx::detail::kind_name;
using ampx::detail::parse_json;

void write_layer(std::ostringstream& o, const LayerPlan& l) {
  o << "    {\n"
    << "      \"module\": " << json_string(l.module) << ",\n"
    << "      \"format\": " << json_string(to_string(l.format)) << ",\n"
    << "      \"scale_rule\": " << json_string(l.scale_rule) << ",\n"
    << "      \"loss_change\": " << json_number(l.loss_change) << ",\n"
    << "      \"grad_error\": " << json_number(l.grad_error) << ",\n"
    << "      \"flops_share\": " << json_number(l.flops_share) << ",\n"
    << "      \"reason\": " << json_string(l.reason) << "\n"
    << "    }";
}

// The fields of one JSON object, read by key with errors naming the file
// (`where`: "ampx::plan::load_plan: 'plan.json'"), the key's path and the value.
class Fields {
 public:
  Fields(const JsonValue& v, std::string path, const std::string& where_text)
      : path_(std::move(path)), where_(where_text) {
    TORCH_CHECK_VALUE(v.kind == JsonValue::Kind::kObject, where(), ": ", path_or_top(),
                      " must be an object, got a ", kind_name(v.kind));
    object_ = &v.object;
  }
  const JsonValue& at(const std::string& key, JsonValue::Kind kind) {
    for (const auto& item : *object_) {
      if (item.first != key) continue;
      seen_.push_back(key);
      // Non-finite numbers are written as strings ("inf", "nan").
      const bool non_finite = kind == JsonValue::Kind::kNumber &&
                              item.second.kind == JsonValue::Kind::kString &&
                              (item.second.string == "inf" || item.second.string == "-inf" ||
                               item.second.string == "nan");
      TORCH_CHECK_VALUE(item.second.kind == kind || non_finite, where(), ": key '", name(key),
                        "' must be a ", kind_name(kind), ", got a ", kind_name(item.second.kind));
      return item.second;
    }
    TORCH_CHECK_VALUE(false, where(), ": key '", name(key), "' is missing");
  }
  std::string string(const std::string& key) { return at(key, JsonValue::Kind::kString).string; }
  double number(const std::string& key) {
    const JsonValue& v = at(key, JsonValue::Kind::kNumber);
    if (v.kind == JsonValue::Kind::kNumber) return v.number;
    return v.string == "nan" ? NAN : v.string == "inf" ? INFINITY : -INFINITY;
  }
  // Every key of the object was read: an unknown one is a typo or another file.
  void no_others() const {
    for (const auto& item : *object_) {
      TORCH_CHECK_VALUE(std::find(seen_.begin(), seen_.end(), item.first) != seen_.end(), where(),
                        ": unknown key '", name(item.first), "'");
    }
  }
  std::string name(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  const std::string& where() const { return where_; }

 private:
  std::string path_or_top() const { return path_.empty() ? "the file" : "'" + path_ + "'"; }
  std::string path_;
  const std::string& where_;
  const std::vector<std::pair<std::string, JsonValue>>* object_ = nullptr;
  std::vector<std::string> seen_;
};

// The layer format at `key` of `f`; an error naming the key and the value otherwise.
LayerFormat format_at(Fields& f, const std::string& key) {
  const std::string format = f.string(key);
  try {
    return parse_layer_format(format, key);
  } catch (const c10::Error&) {
    TORCH_CHECK_VALUE(false, f.where(), ": key '", f.name(key), "' has value '", format,
                      "', not a layer format (fp32, fp16, bf16, fp8-block, fp8, mxfp8, nvfp4)");
  }
}

LayerPlan read_layer(const JsonValue& v, const std::string& path, const std::string& where) {
  Fields f(v, path, where);
  LayerPlan l;
  l.module = f.string("module");
  TORCH_CHECK_VALUE(!l.module.empty(), f.where(), ": key '", f.name("module"), "' is empty");
  l.format = format_at(f, "format");
  l.scale_rule = f.string("scale_rule");
  l.loss_change = f.number("loss_change");
  l.grad_error = f.number("grad_error");
  l.flops_share = f.number("flops_share");
  l.reason = f.string("reason");
  f.no_others();
  return l;
}

Floor read_floor(const JsonValue& v, const std::string& path, const std::string& where) {
  Fields f(v, path, where);
  Floor floor;
  floor.prefix = f.string("prefix");
  TORCH_CHECK_VALUE(!floor.prefix.empty(), f.where(), ": key '", f.name("prefix"), "' is empty");
  floor.format = format_at(f, "format");
  f.no_others();
  return floor;
}

// A plan from its JSON text; errors start with `where`.
PrecisionPlan read_plan(const std::string& text, const std::string& where) {
  const JsonValue doc = parse_json(text, where);
  Fields top(doc, "", where);
  const double version = top.number("version");
  TORCH_CHECK_VALUE(version >= 1 && version <= kPlanVersion && version == std::floor(version),
                    top.where(),
                    ": key 'version' has value ", version, "; this ampx reads versions 1 to ",
                    kPlanVersion);
  PrecisionPlan plan;
  plan.target = top.string("target");
  if (version >= 2) {
    const std::string reference = top.string("reference");
    const bool known = reference == "bf16" || reference == "fp32";
    TORCH_CHECK_VALUE(known, top.where(), ": key 'reference' has value '", reference,
                      "', not a reference format (bf16, fp32)");
    plan.reference = parse_layer_format(reference, "reference");
  }
  plan.loss_budget = top.number("loss_budget");
  TORCH_CHECK_VALUE(plan.loss_budget > 0 && std::isfinite(plan.loss_budget), top.where(),
                    ": key 'loss_budget' has value ", plan.loss_budget, ", must be > 0");
  plan.predicted_loss_change = top.number("predicted_loss_change");
  plan.cost = top.number("cost");
  plan.bf16_cost = top.number("bf16_cost");
  if (version >= 3) {
    plan.tail = top.number("tail");
    TORCH_CHECK_VALUE(plan.tail >= 0 && plan.tail < 1, top.where(), ": key 'tail' has value ",
                      plan.tail, ", must be in [0, 1)");
  }
  if (version >= 4) {
    const JsonValue& floors = top.at("floors", JsonValue::Kind::kArray);
    for (size_t i = 0; i < floors.array.size(); ++i) {
      const std::string key = "floors[" + std::to_string(i) + "]";
      plan.floors.push_back(read_floor(floors.array[i], key, where));
    }
  }
  const JsonValue& layers = top.at("layers", JsonValue::Kind::kArray);
  for (size_t i = 0; i < layers.array.size(); ++i) {
    const std::string key = "layers[" + std::to_string(i) + "]";
    plan.layers.push_back(read_layer(layers.array[i], key, where));
    const LayerFormat f = plan.layers.back().format;
    TORCH_CHECK_VALUE(version >= 2 || !detail::is_wide(f),
                      top.where(), ": key '", key, ".format' has value '", to_string(f),
                      "', which version 1 files do not hold");
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK_VALUE(plan.layers[j].module != plan.layers[i].module, top.where(), ": key '", key,
                        ".module' repeats module '", plan.layers[i].module, "' of layers[", j, "]");
    }
    for (size_t j = 0; j < plan.floors.size(); ++j) {
      const Floor& floor = plan.floors[j];
      TORCH_CHECK_VALUE(!detail::is_under(plan.layers[i].module, floor.prefix) ||
                            element_bits(f) >= element_bits(floor.format),
                        top.where(),
                        ": key '", key, ".format' has value '", to_string(f),
                        "', narrower than floors[", j, "] ('", floor.prefix, "', ",
                        to_string(floor.format), ")");
    }
  }
  top.no_others();
  return plan;
}

}  // namespace

void save_plan(const PrecisionPlan& plan, const std::string& path) {
  TORCH_CHECK_VALUE(
      plan.reference == LayerFormat::kBFloat16 || plan.reference == LayerFormat::kFloat32,
      "ampx::plan::save_plan: the plan's reference must be bf16 or fp32, got ",
      to_string(plan.reference));
  const bool wide = std::any_of(plan.layers.begin(), plan.layers.end(),
                                [](const LayerPlan& l) { return detail::is_wide(l.format); });
  TORCH_CHECK_VALUE(plan.tail >= 0 && plan.tail < 1,
                    "ampx::plan::save_plan: the plan's tail must be in [0, 1), got ", plan.tail);
  // What load_plan refuses is not written.
  for (const auto& floor : plan.floors) {
    TORCH_CHECK_VALUE(!floor.prefix.empty(), "ampx::plan::save_plan: a floor (",
                      to_string(floor.format), ") has an empty prefix");
    for (const auto& l : plan.layers) {
      TORCH_CHECK_VALUE(!detail::is_under(l.module, floor.prefix) ||
                            element_bits(l.format) >= element_bits(floor.format),
                        "ampx::plan::save_plan: layer '", l.module, "' is ", to_string(l.format),
                        ", narrower than its floor '", floor.prefix, "' (",
                        to_string(floor.format), ")");
    }
  }
  const int64_t version = !plan.floors.empty() ? 4
                          : plan.tail > 0       ? 3
                          : plan.reference == LayerFormat::kBFloat16 && !wide ? 1
                                                                              : 2;
  std::ostringstream o;
  o << "{\n"
    << "  \"version\": " << version << ",\n"
    << "  \"target\": " << json_string(plan.target) << ",\n";
  if (version >= 2) o << "  \"reference\": " << json_string(to_string(plan.reference)) << ",\n";
  o << "  \"loss_budget\": " << json_number(plan.loss_budget) << ",\n"
    << "  \"predicted_loss_change\": " << json_number(plan.predicted_loss_change) << ",\n"
    << "  \"cost\": " << json_number(plan.cost) << ",\n"
    << "  \"bf16_cost\": " << json_number(plan.bf16_cost) << ",\n";
  if (version >= 3) o << "  \"tail\": " << json_number(plan.tail) << ",\n";
  if (version >= 4) {
    o << "  \"floors\": [";
    for (size_t i = 0; i < plan.floors.size(); ++i) {
      o << (i ? ",\n" : "\n") << "    {\"prefix\": " << json_string(plan.floors[i].prefix)
        << ", \"format\": " << json_string(to_string(plan.floors[i].format)) << "}";
    }
    o << "\n  ],\n";
  }
  o << "  \"layers\": [";
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    o << (i ? ",\n" : "\n");
    write_layer(o, plan.layers[i]);
  }
  o << (plan.layers.empty() ? "]\n" : "\n  ]\n") << "}\n";
  const std::string text = o.str();
  ampx::detail::write_file_atomically(path, text.data(), text.size(), "ampx::plan::save_plan");
}

PrecisionPlan load_plan(const std::string& path) {
  const auto bytes = ampx::detail::read_file(path);
  TORCH_CHECK_VALUE(bytes.has_value(), "ampx::plan::load_plan: cannot read '", path,
                    "': ", std::strerror(errno));
  return read_plan(*bytes, "ampx::plan::load_plan: '" + path + "'");
}

PrecisionPlan parse_plan(const std::string& text, const std::string& source) {
  return read_plan(text, "ampx::plan::parse_plan: '" + source + "'");
}

}  // namespace plan
}  // namespace ampx
