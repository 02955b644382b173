#include "shard_checkpoint.h"

#include "rank_agreement.h"

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <regex>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace ampx::train {
namespace {

namespace fs = std::filesystem;

std::string message_of(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

/// Throws on every rank when some rank's `error` is not empty, naming the first.
void throw_if_any_failed(const ampx::dist::ProcessGroup& group, const std::string& error,
                         const std::string& what) {
  const auto errors = group.all_gather_bytes(error);
  for (size_t r = 0; r < errors.size(); ++r) {
    TORCH_CHECK(errors[r].empty(), "ampx-train: rank ", r, " could not ", what, ": ", errors[r]);
  }
}

/// Removes the shard files beside `path` that `files` does not name.
void remove_other_shard_files(const fs::path& path, const nlohmann::json& files) {
  const std::regex shard_name(
      std::regex_replace(path.stem().string(), std::regex(R"([.^$|()\[\]{}*+?\\])"), R"(\$&)") +
      R"(-step[0-9]+-rank[0-9]+-of[0-9]+\.ampx)");
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(path.parent_path(), ec)) {
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, shard_name)) continue;
    if (std::find(files.begin(), files.end(), name) != files.end()) continue;
    fs::remove(entry.path(), ec);  // a file left behind costs room, not correctness
  }
}

/// The checked "shards" of a checkpoint's description: the world size and
/// the shard files' names (plain names, beside the checkpoint).
std::pair<int64_t, std::vector<std::string>> shard_files_of(const fs::path& path,
                                                            const nlohmann::json& meta) {
  const std::string where = "ampx-train: checkpoint '" + path.string() + "'";
  TORCH_CHECK(meta.contains("shards"), where,
              " holds the whole model (a run with --shard none or optimizer wrote it); resume it "
              "with that --shard");
  const auto& shards = meta.at("shards");
  TORCH_CHECK(shards.is_object() && shards.contains("world_size") && shards.contains("files"),
              where, " has shards=", shards.dump(), "; expected its world_size and files");
  const auto& world = shards.at("world_size");
  const auto& files = shards.at("files");
  TORCH_CHECK(world.is_number_integer() && world.get<int64_t>() >= 1 &&
                  world.get<int64_t>() <= (1 << 20) && files.is_array() &&
                  files.size() == world.get<size_t>(),
              where, " has shards=", shards.dump(), "; expected one file per rank");
  std::vector<std::string> names;
  for (const auto& f : files) {
    TORCH_CHECK(f.is_string(), where, " names a shard file ", f.dump(), "; expected a file name");
    const std::string name = f.get<std::string>();
    TORCH_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..",
                where, " names a shard file '", name, "' that is not a file beside it");
    names.push_back(name);
  }
  return {world.get<int64_t>(), names};
}

}  // namespace

std::string shard_file_name(const fs::path& path, int64_t step, int64_t rank, int64_t world) {
  return path.stem().string() + "-step" + std::to_string(step) + "-rank" + std::to_string(rank) +
         "-of" + std::to_string(world) + ".ampx";
}

void read_shard_file(const fs::path& file, int64_t rank, int64_t world, int64_t step,
                     const nlohmann::json& identity, torch::serialize::InputArchive& archive) {
  const Checkpoint c = read_checkpoint(file);
  const auto& m = c.meta;
  const auto field = [&](const char* key) {
    return m.is_object() && m.contains(key) ? m.at(key).dump() : std::string("(none)");
  };
  const auto integer_is = [&](const char* key, int64_t want) {
    return m.is_object() && m.contains(key) && m.at(key).is_number_integer() &&
           m.at(key).get<int64_t>() == want;
  };
  TORCH_CHECK(m.is_object() && m.value("format", nlohmann::json()) == "ampx-train shard",
              "ampx-train: '", file.string(), "' is a checkpoint but not a shard file (format ",
              field("format"), ")");
  TORCH_CHECK(
      integer_is("rank", rank) && integer_is("world_size", world) && integer_is("step", step),
      "ampx-train: shard file '", file.string(), "' is rank ", field("rank"), " of ",
      field("world_size"), " at step ", field("step"), "; its checkpoint expects rank ", rank,
      " of ", world, " at step ", step);
  TORCH_CHECK(m.contains("run") && m.at("run").is_object(), "ampx-train: shard file '",
              file.string(), "' does not say which run wrote it (no \"run\" object)");
  check_compatible(file, m.at("run"), identity);
  read_payload(file, c, archive);
}

void save_sharded_checkpoint(const fs::path& path, const nlohmann::json& identity,
                             int64_t steps_per_epoch, const ShardIo& shards, ampx::AmpSession& amp,
                             const RunState& state, const ampx::dist::ProcessGroup& group) {
  const int64_t rank = group.rank(), world = group.world_size(), step = state.next_step;
  std::string error;
  try {
    torch::serialize::OutputArchive archive;
    shards.save(archive);
    std::ostringstream payload;
    archive.save_to(payload);
    const nlohmann::json meta = {{"format", "ampx-train shard"},
                                 {"run", identity},
                                 {"step", step},
                                 {"rank", rank},
                                 {"world_size", world}};
    fs::create_directories(path.parent_path());
    write_checkpoint(path.parent_path() / shard_file_name(path, step, rank, world), meta,
                     payload.str());
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  throw_if_any_failed(group, error,
                      "write its shard of the checkpoint at step " + std::to_string(step) + " ('" +
                          path.string() + "' is kept as it was)");
  from_rank0(&group, [&] {
    nlohmann::json meta = checkpoint_meta(identity, steps_per_epoch, amp, state);
    nlohmann::json files = nlohmann::json::array();
    for (int64_t r = 0; r < world; ++r) files.push_back(shard_file_name(path, step, r, world));
    meta["shards"] = {{"world_size", world}, {"files", files}};
    torch::serialize::OutputArchive archive;
    save_cpu_generator(archive);
    std::ostringstream payload;
    archive.save_to(payload);
    write_checkpoint(path, meta, payload.str());
    remove_other_shard_files(path, files);
    return std::string();
  });
}

RunState load_sharded_checkpoint(const fs::path& path, const std::string& bytes,
                                 const nlohmann::json& identity, const ShardIo& shards,
                                 ampx::AmpSession& amp, const ampx::dist::ProcessGroup& group) {
  const Checkpoint c = parse_checkpoint(bytes, path);
  const auto [world, files] = shard_files_of(path, c.meta);
  check_compatible(path, c.meta.at("run"), identity);
  CheckpointProgress progress = read_progress(path, c);  // checked before anything is restored
  torch::serialize::InputArchive archive;
  read_payload(path, c, archive);
  torch::Tensor rng;
  try {
    rng = read_cpu_generator(archive);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "ampx-train: checkpoint '", path.string(),
                "' has no CPU generator state: ", e.what_without_backtrace());
  }
  const int64_t step = progress.state.next_step;
  shards.load(world, [&](int64_t r, torch::serialize::InputArchive& shard) {
    read_shard_file(path.parent_path() / files[static_cast<size_t>(r)], r, world, step, identity,
                    shard);
  });
  set_cpu_generator(rng);
  amp.load_state_dict(progress.scalers);
  return std::move(progress.state);
}

}  // namespace ampx::train
