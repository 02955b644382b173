#pragma once

// Fuzz targets: every reader of bytes from outside ampx, behind one
// signature (libFuzzer's LLVMFuzzerTestOneInput, one function per reader).
// A target returns normally or throws c10::Error / std::exception for input
// it refuses; anything else (a crash, a hang, an allocation past the
// driver's limit, a loaded loss scale that is not finite and > 0) is a
// finding. fuzz_driver.cpp runs them; tests/fuzz/README.md says how.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ampx::fuzz {

using Target = void (*)(const uint8_t* data, size_t size);

struct NamedTarget {
  const char* name;
  Target run;
  const char* what;            // the reader it drives
  const char* seeds = nullptr;  // its folder of corpus/ when not `name` (shared seeds)

  /// The folder of tests/fuzz/corpus/ that holds its seeds.
  const char* corpus() const { return seeds ? seeds : name; }
};

/// Every target, by name: checkpoint, checkpoint_crc, checkpoint_state, state_dict,
/// zero_shard, fsdp_shard, train_shard, optim_state, idx, text, launch_env, safetensors, plan_file.
/// The one list
/// of them: `ampx_fuzz list` prints it for ctest's tests (CMakeLists.txt) and `make fuzz`.
const std::vector<NamedTarget>& targets();

/// Writes a small valid input for each target into <dir>/<target>/seed-*
/// (how the checked-in corpora were made, with ampx's own writers).
void write_seeds(const std::string& dir);

/// The sharded checkpoints' targets (shard_targets.cpp).
void fsdp_shard(const uint8_t* data, size_t size);
void train_shard(const uint8_t* data, size_t size);

/// ampx::optim's state files (optim_targets.cpp).
void optim_state(const uint8_t* data, size_t size);

/// A seed: its target's corpus folder, its file name, its bytes.
struct Seed {
  std::string target, name, bytes;
};
/// optim_state's seed: an 8-bit, Kahan AdamW's state after two steps.
std::vector<Seed> optim_seeds();
/// fsdp_shard's and train_shard's seeds: a shard after two AdamW steps.
std::vector<Seed> shard_seeds();

/// Writes `size` bytes at `data` to `path`.
void write_file(const std::string& path, const uint8_t* data, size_t size);
/// The bytes of the file at `path`.
std::string read_whole(const std::string& path);
/// `data` as a checkpoint whose header's CRC-32 fits its (mutated) content,
/// as a hostile file would have it.
std::vector<uint8_t> with_valid_crc(const uint8_t* data, size_t size);

/// Where targets that need a file write their input (a tmpfs when there is one).
std::string scratch_file(const char* name);

}  // namespace ampx::fuzz
