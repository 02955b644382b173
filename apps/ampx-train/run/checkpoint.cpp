#include "checkpoint.h"

#include "files/archive_check.h"  // ampx's src/: bounds of LibTorch archives
#include "files/atomic_file.h"    // ampx's src/: crash-safe writes

#include <ampx/precision_plan.h>
#include <ampx/version.h>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/serialize/output-archive.h>
#include <zlib.h>

#include <cstring>
#include <limits>
#include <mutex>
#include <sstream>

namespace ampx::train {
namespace {

constexpr char kMagic[8] = {'A', 'M', 'P', 'X', 'C', 'K', 'P', 'T'};
constexpr size_t kHeaderBytes = 8 + 4 + 8 + 8 + 4;

template <typename T>
void put_le(std::string& out, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    out.push_back(static_cast<char>((static_cast<uint64_t>(value) >> (8 * i)) & 0xff));
  }
}

template <typename T>
T get_le(const std::string& in, size_t offset) {
  uint64_t value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    value |= static_cast<uint64_t>(static_cast<unsigned char>(in[offset + i])) << (8 * i);
  }
  return static_cast<T>(value);
}

uint32_t crc32_of(const std::string& a, const std::string& b) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  // zlib takes uInt lengths: feed in pieces so files past 4 GiB work too.
  for (const std::string* s : {&a, &b}) {
    const auto* p = reinterpret_cast<const Bytef*>(s->data());
    size_t left = s->size();
    while (left > 0) {
      const uInt n = static_cast<uInt>(std::min<size_t>(left, 1u << 30));
      crc = ::crc32(crc, p, n);
      p += n;
      left -= n;
    }
  }
  return static_cast<uint32_t>(crc);
}

std::string hex_crc(uint32_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

}  // namespace

void write_checkpoint(const std::filesystem::path& path, const nlohmann::json& meta,
                      const std::string& payload) {
  const std::string meta_text = meta.dump();
  std::string bytes(kMagic, sizeof(kMagic));
  bytes.reserve(kHeaderBytes + meta_text.size() + payload.size());
  put_le<uint32_t>(bytes, kCheckpointVersion);
  put_le<uint64_t>(bytes, meta_text.size());
  put_le<uint64_t>(bytes, payload.size());
  put_le<uint32_t>(bytes, crc32_of(meta_text, payload));
  bytes += meta_text;
  bytes += payload;
  ampx::detail::write_file_atomically(path.string(), bytes.data(), bytes.size(),
                                      "ampx-train: checkpoint");
}

std::string read_checkpoint_bytes(const std::filesystem::path& path) {
  auto bytes = ampx::detail::read_file(path.string());
  TORCH_CHECK(bytes, "ampx-train: cannot open checkpoint '", path.string(), "'");
  return std::move(*bytes);
}

Checkpoint read_checkpoint(const std::filesystem::path& path) {
  return parse_checkpoint(read_checkpoint_bytes(path), path);
}

Checkpoint parse_checkpoint(const std::string& bytes, const std::filesystem::path& path) {
  const std::string where = "ampx-train: checkpoint '" + path.string() + "'";
  TORCH_CHECK(
      bytes.size() >= sizeof(kMagic) && std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0,
      where, " is not an ampx-train checkpoint (no AMPXCKPT header; ", bytes.size(), " bytes)");
  TORCH_CHECK(bytes.size() >= kHeaderBytes, where, " is truncated: ", bytes.size(),
              " bytes, shorter than its ", kHeaderBytes, "-byte header");
  const auto version = get_le<uint32_t>(bytes, 8);
  TORCH_CHECK(version == kCheckpointVersion, where, " has format version ", version,
              "; this ampx-train reads version ", kCheckpointVersion);
  const auto meta_bytes = get_le<uint64_t>(bytes, 12);
  const auto payload_bytes = get_le<uint64_t>(bytes, 20);
  const auto stored_crc = get_le<uint32_t>(bytes, 28);
  const uint64_t body = bytes.size() - kHeaderBytes;
  // Compare without adding the two lengths: a damaged header must not overflow.
  TORCH_CHECK(meta_bytes <= body && payload_bytes <= body - meta_bytes, where,
              " is truncated: its header promises ", meta_bytes, " + ", payload_bytes,
              " bytes of content, the file holds ", body);
  TORCH_CHECK(meta_bytes + payload_bytes == body, where,
              " is corrupted: ", body - meta_bytes - payload_bytes,
              " bytes past the end its header gives");
  Checkpoint c;
  const std::string meta_text = bytes.substr(kHeaderBytes, meta_bytes);
  c.payload = bytes.substr(kHeaderBytes + meta_bytes);
  const uint32_t crc = crc32_of(meta_text, c.payload);
  TORCH_CHECK(crc == stored_crc, where, " is corrupted: CRC-32 of its content is ", hex_crc(crc),
              ", the header says ", hex_crc(stored_crc));
  try {
    c.meta = nlohmann::json::parse(meta_text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, where, " has an unreadable description: ", e.what());
  }
  TORCH_CHECK(c.meta.is_object() && c.meta.contains("run") && c.meta.contains("step"), where,
              " has no run description or step");
  return c;
}

void read_payload(const std::filesystem::path& path, const Checkpoint& c,
                  torch::serialize::InputArchive& archive) {
  const std::string where = "ampx-train: checkpoint '" + path.string() + "'";
  ampx::detail::load_output_archive(c.payload, archive, where);
}

CheckpointProgress read_progress(const std::filesystem::path& path, const Checkpoint& c) {
  const std::string where = "ampx-train: checkpoint '" + path.string() + "'";
  const auto field = [&](const char* key) -> const nlohmann::json& {
    const auto it = c.meta.find(key);
    TORCH_CHECK(it != c.meta.end(), where, " has no '", key, "' in its description");
    return *it;
  };
  const auto count = [&](const char* key) {
    const auto& j = field(key);
    TORCH_CHECK(j.is_number_integer() && j.get<int64_t>() >= 0, where, " has ", key, "=", j.dump(),
                "; expected an integer >= 0");
    return j.get<int64_t>();
  };
  CheckpointProgress out;
  RunState& state = out.state;
  state.next_step = count("step");
  state.skipped = count("skipped");
  TORCH_CHECK(state.skipped <= state.next_step, where, " has skipped=", state.skipped,
              " steps of its ", state.next_step);
  const auto& losses = field("losses");
  TORCH_CHECK(losses.is_array() && losses.size() == static_cast<size_t>(state.next_step), where,
              " has ",
              losses.is_array() ? std::to_string(losses.size()) + " losses" : losses.type_name(),
              " for its ", state.next_step, " steps; expected one loss per step");
  for (const auto& l : losses) {
    // JSON has no NaN or infinity: nlohmann writes them as null.
    TORCH_CHECK(l.is_number() || l.is_null(), where, " has a loss of ", l.dump(),
                "; expected a number");
    state.losses.push_back(l.is_null() ? std::numeric_limits<double>::quiet_NaN()
                                       : l.get<double>());
  }
  if (const auto it = c.meta.find("plan_formats"); it != c.meta.end()) {
    TORCH_CHECK(it->is_object(), where, " has plan_formats=", it->dump(),
                "; expected the watched plan's formats by module");
    for (const auto& [module, format] : it->items()) {
      TORCH_CHECK(format.is_string(), where, " has plan_formats '", module, "' = ", format.dump(),
                  "; expected a layer format's name");
      const std::string name = format.get<std::string>();
      try {
        (void)ampx::plan::parse_layer_format(name);
      } catch (const c10::Error&) {
        TORCH_CHECK(false, where, " has plan_formats '", module, "' = '", name,
                    "', not a layer format");
      }
      state.plan_formats[module] = name;
    }
  }
  if (const auto it = c.meta.find("plan_file"); it != c.meta.end()) {
    TORCH_CHECK(it->is_string(), where, " has plan_file of type ", it->type_name(),
                "; expected the text of the run's plan file");
    state.plan_file = it->get<std::string>();
  }
  const auto& amp = field("amp");
  TORCH_CHECK(amp.is_object(), where, " has amp=", amp.type_name(),
              "; expected the loss scalers' states as an object");
  for (const auto& [name, state] : amp.items()) {
    TORCH_CHECK(state.is_object(), where, " has a loss scaler '", name, "' of type ",
                state.type_name(), "; expected an object");
    ampx::StateDict dict;
    for (const auto& [key, value] : state.items()) {
      if (value.is_number_integer()) {
        dict[key] = value.get<int64_t>();
      } else if (value.is_number()) {
        dict[key] = value.get<double>();
      } else if (value.is_boolean()) {
        dict[key] = value.get<bool>();
      } else if (value.is_null()) {
        dict[key] = c10::IValue();
      } else {
        TORCH_CHECK(value.is_string(), where, " has loss scaler '", name, "' state '", key,
                    "' = ", value.dump(), "; expected a number, boolean, string or null");
        dict[key] = value.get<std::string>();
      }
    }
    out.scalers[name] = std::move(dict);
  }
  return out;
}

nlohmann::json state_dict_to_json(const ampx::StateDict& dict) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [key, value] : dict) {
    if (value.isDouble()) {
      out[key] = value.toDouble();
    } else if (value.isInt()) {
      out[key] = value.toInt();
    } else if (value.isBool()) {
      out[key] = value.toBool();
    } else if (value.isNone()) {
      out[key] = nullptr;
    } else {
      TORCH_CHECK(value.isString(), "ampx-train: scaler state '", key, "' has an unexpected type");
      out[key] = value.toStringRef();
    }
  }
  return out;
}

nlohmann::json checkpoint_meta(const nlohmann::json& identity, int64_t steps_per_epoch,
                               ampx::AmpSession& amp, const RunState& state) {
  nlohmann::json amp_state = nlohmann::json::object();
  for (const auto& [name, dict] : amp.state_dict()) amp_state[name] = state_dict_to_json(dict);
  nlohmann::json meta = {
      {"format", "ampx-train checkpoint"},
      {"run", identity},
      {"step", state.next_step},
      {"epoch", state.next_step / steps_per_epoch},
      {"position_in_epoch", state.next_step % steps_per_epoch},
      {"skipped", state.skipped},
      {"losses", state.losses},
      {"amp", amp_state},
      {"torch_version", ampx::torch_version()},
  };
  if (!state.plan_formats.empty()) meta["plan_formats"] = state.plan_formats;
  if (!state.plan_file.empty()) meta["plan_file"] = state.plan_file;
  return meta;
}

void save_cpu_generator(torch::serialize::OutputArchive& archive) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  archive.write("rng/cpu", gen.get_state());
}

torch::Tensor read_cpu_generator(torch::serialize::InputArchive& archive) {
  torch::Tensor rng;
  archive.read("rng/cpu", rng);
  return rng;
}

void set_cpu_generator(const torch::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

void save_checkpoint(const std::filesystem::path& path, const nlohmann::json& identity,
                     int64_t steps_per_epoch, const TrainingObjects& objects,
                     const RunState& state) {
  torch::serialize::OutputArchive archive, model_archive, opt_archive;
  objects.model.save(model_archive);
  objects.optimizer.save(opt_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", opt_archive);
  save_cpu_generator(archive);
  std::ostringstream payload;
  archive.save_to(payload);
  std::filesystem::create_directories(path.parent_path());
  write_checkpoint(path, checkpoint_meta(identity, steps_per_epoch, objects.amp, state),
                   payload.str());
}

RunState load_checkpoint(const std::filesystem::path& path, const std::string& bytes,
                         const nlohmann::json& identity, const TrainingObjects& objects) {
  const Checkpoint c = parse_checkpoint(bytes, path);
  TORCH_CHECK(!c.meta.contains("shards"), "ampx-train: checkpoint '", path.string(),
              "' holds no weights: a run with --shard full or grad wrote them in its ranks' shard "
              "files; resume it with --shard full or grad");
  check_compatible(path, c.meta.at("run"), identity);
  CheckpointProgress progress = read_progress(path, c);  // checked before anything is restored
  torch::serialize::InputArchive archive, model_archive, opt_archive;
  read_payload(path, c, archive);
  try {
    archive.read("model", model_archive);
    archive.read("optimizer", opt_archive);
    objects.model.load(model_archive);
    objects.optimizer.load(opt_archive);
    set_cpu_generator(read_cpu_generator(archive));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "ampx-train: checkpoint '", path.string(),
                "' passed its checks but its content does not fit this model: ",
                e.what_without_backtrace());
  }
  objects.amp.load_state_dict(progress.scalers);
  return std::move(progress.state);
}

void check_compatible(const std::filesystem::path& path, const nlohmann::json& saved,
                      const nlohmann::json& expected) {
  for (const auto& [key, value] : expected.items()) {
    const auto it = saved.find(key);
    // Settings checkpoints have recorded since: an older one is not refused for lacking them.
    const bool came_later = key == "plan" || key == "plan_target";
    if (came_later && it == saved.end()) continue;
    // Runs before the tails had none: such a checkpoint trained with a tail of 0.
    const bool present = it != saved.end() || key == "plan_tail" || key == "fp8_tail";
    const nlohmann::json was = it != saved.end() ? *it : nlohmann::json(0.0);
    const std::string have = present ? was.dump() : std::string("(none)");
    TORCH_CHECK(present && was == value, "ampx-train: checkpoint '", path.string(),
                "' was written by a run with ", key, "=", have, ", this run has ", key, "=",
                value.dump(),
                "; resume it with the same settings, or pass another --checkpoint-dir");
  }
}

}  // namespace ampx::train
