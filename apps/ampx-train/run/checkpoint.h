#pragma once

// ampx-train's checkpoint files: a JSON description of the run and a LibTorch
// archive (model, optimizer with masters and states, loss scalers, RNG, data
// position), framed so that damage is detected before anything is restored.
//
//   save_checkpoint(path, identity, steps_per_epoch, {model, opt, amp}, state);  // atomic
//   RunState state = load_checkpoint(path, read_checkpoint_bytes(path), identity,
//                                    {model, opt, amp});  // checked, then restored
//
// and below them the file's framing, for tests and fuzzing:
//
//   write_checkpoint(dir / "checkpoint.ampx", meta, archive_bytes);  // atomic
//   Checkpoint c = read_checkpoint(dir / "checkpoint.ampx");         // checked
//   check_compatible(path, c.meta["run"], this_run);                 // same run?
//
// Layout, little-endian:
//   "AMPXCKPT" | u32 version | u64 meta bytes | u64 payload bytes |
//   u32 CRC-32 (zlib) of meta + payload | meta (JSON text) | payload

#include <ampx/amp.h>
#include <ampx/state_dict.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace ampx::train {

inline constexpr uint32_t kCheckpointVersion = 1;

/// Where a run stands beyond its weights: what the training loop carries from
/// step to step and a checkpoint saves and restores.
struct RunState {
  int64_t next_step = 0;       // the next step to run
  int64_t skipped = 0;         // steps the loss scaler skipped so far
  std::vector<double> losses;  // one per step run (NaN where JSON has null)
  /// --plan-widen: every planned layer's format as the watch left it
  /// (module -> "mxfp8", ...); empty while it has moved none.
  std::map<std::string, std::string> plan_formats;
  /// --precision auto: the text of the plan file the run applies, which
  /// --resume without --precision-plan applies again (empty otherwise).
  std::string plan_file;
};

/// What a checkpoint holds besides the RunState (ampx::AmpSession's loss
/// scalers included, the CPU generator's state too).
struct TrainingObjects {
  torch::nn::Module& model;
  torch::optim::Optimizer& optimizer;
  ampx::AmpSession& amp;
};

/// Writes the checkpoint of a run whose settings are `identity` at `state`
/// (atomically, creating the folder): `objects`, the CPU generator, the
/// state, its epoch from `steps_per_epoch`.
void save_checkpoint(const std::filesystem::path& path, const nlohmann::json& identity,
                     int64_t steps_per_epoch, const TrainingObjects& objects,
                     const RunState& state);

/// The bytes of the file at `path` (rank 0 reads them; the others get them
/// broadcast). Errors name the path.
std::string read_checkpoint_bytes(const std::filesystem::path& path);

/// Restores `objects` and the CPU generator from the checkpoint `bytes`
/// read from `path`, and returns its RunState. Everything is checked first
/// (framing, CRC, same run settings as `identity`, progress fields, archive
/// bounds): an error restores nothing it has not checked, and names `path`.
RunState load_checkpoint(const std::filesystem::path& path, const std::string& bytes,
                         const nlohmann::json& identity, const TrainingObjects& objects);

/// The description a checkpoint of a run with settings `identity` at
/// `state` carries (its "run", "step", "losses", loss scalers ...).
nlohmann::json checkpoint_meta(const nlohmann::json& identity, int64_t steps_per_epoch,
                               ampx::AmpSession& amp, const RunState& state);
/// The CPU generator's state, as "rng/cpu".
void save_cpu_generator(torch::serialize::OutputArchive& archive);
torch::Tensor read_cpu_generator(torch::serialize::InputArchive& archive);
void set_cpu_generator(const torch::Tensor& state);

struct Checkpoint {
  nlohmann::json meta;
  std::string payload;
};

/// Writes through ampx::detail::write_file_atomically: a crash mid-write leaves the
/// previous checkpoint at `path` intact.
void write_checkpoint(const std::filesystem::path& path, const nlohmann::json& meta,
                      const std::string& payload);

/// Reads and verifies a checkpoint. Errors name the path and say what is
/// wrong: missing, not a checkpoint, newer version, truncated, corrupted.
Checkpoint read_checkpoint(const std::filesystem::path& path);

/// The same checks on a checkpoint file's `bytes` (read by another rank, on
/// another host); `path` names it in errors.
Checkpoint parse_checkpoint(const std::string& bytes, const std::filesystem::path& path);
/// Reads the LibTorch archive in `c`'s payload into `archive`, its length
/// fields checked first (src/files/archive_check.h): a hostile or damaged payload
/// with a valid CRC cannot make LibTorch allocate without bound. Errors name
/// `path`.
void read_payload(const std::filesystem::path& path, const Checkpoint& c,
                  torch::serialize::InputArchive& archive);

/// Where a run stood when a checkpoint was written, from its meta.
struct CheckpointProgress {
  RunState state;
  std::map<std::string, ampx::StateDict> scalers;  // ampx::AmpSession::state_dict()
};

/// The meta's step, skipped, losses and loss-scaler states, each checked
/// (types, step >= 0, 0 <= skipped <= step, one loss per step; each scaler
/// state a JSON object of numbers, booleans, strings and nulls): errors name
/// `path` and the field. GradScaler::load_state_dict checks the values.
CheckpointProgress read_progress(const std::filesystem::path& path, const Checkpoint& c);
/// A StateDict of plain values as JSON (the inverse of read_progress's scalers).
nlohmann::json state_dict_to_json(const ampx::StateDict& dict);

/// Errors unless every key of `expected` has the same value in `saved` (the
/// `run` object of a checkpoint's meta); the message names the key and both
/// values as JSON, e.g. `was written by a run with precision="O2", this run
/// has precision="O1"`. Keys checkpoints record only since a later version
/// (`plan`, `plan_target`) are compared where the checkpoint has them.
void check_compatible(const std::filesystem::path& path, const nlohmann::json& saved,
                      const nlohmann::json& expected);

}  // namespace ampx::train
