#include "targets.h"

#include "run/checkpoint.h"
#include "run/data.h"

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <ampx/precision_plan.h>
#include <ampx/serialize.h>
#include <ampx/zero.h>

#include <c10/util/Exception.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <unistd.h>
#include <zlib.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>

namespace ampx::fuzz {

void write_file(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  TORCH_CHECK(out.good(), "fuzz: cannot write ", path);
}

std::string read_whole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<uint8_t> with_valid_crc(const uint8_t* data, size_t size) {
  constexpr size_t kHeader = 32, kCrcAt = 28;
  std::vector<uint8_t> bytes(data, data + size);
  if (size >= kHeader) {
    const uint32_t crc = static_cast<uint32_t>(
        ::crc32(::crc32(0L, Z_NULL, 0), bytes.data() + kHeader, static_cast<uInt>(size - kHeader)));
    for (size_t i = 0; i < 4; ++i) bytes[kCrcAt + i] = static_cast<uint8_t>(crc >> (8 * i));
  }
  return bytes;
}

namespace {

/// A loaded scaler state must give a usable scale; anything else is a finding.
void check_scale(const ampx::GradScaler& scaler) {
  const double scale = scaler.get_scale();
  if (!(std::isfinite(scale) && scale > 0)) {
    std::fprintf(stderr, "fuzz: a loaded GradScaler state has scale %g\n", scale);
    std::abort();
  }
}

// ampx-train's checkpoint reader; a checkpoint it accepts then goes through
// LibTorch's archive reader as the trainer's resume does.
void checkpoint(const uint8_t* data, size_t size) {
  const std::string path = scratch_file("checkpoint.ampx");
  write_file(path, data, size);
  const auto c = ampx::train::read_checkpoint(path);
  torch::serialize::InputArchive archive;
  ampx::train::read_payload(path, c, archive);
}

// The same reader on files given a valid CRC-32: the lengths, the JSON and
// the archive get fuzzed too.
void checkpoint_crc(const uint8_t* data, size_t size) {
  const auto bytes = with_valid_crc(data, size);
  checkpoint(bytes.data(), bytes.size());
}

// What a resume takes from a checkpoint's JSON description (the CRC-32
// recomputed as in checkpoint_crc): step, skipped steps, losses, and the
// loss scalers' states, each loaded into a GradScaler whose scale must then
// be usable.
void checkpoint_state(const uint8_t* data, size_t size) {
  const auto bytes = with_valid_crc(data, size);
  const std::string path = scratch_file("state.ampx");
  write_file(path, bytes.data(), bytes.size());
  const auto progress = ampx::train::read_progress(path, ampx::train::read_checkpoint(path));
  const auto& state = progress.state;
  if (!(state.next_step >= 0 && state.skipped >= 0 && state.skipped <= state.next_step &&
        state.losses.size() == static_cast<size_t>(state.next_step))) {
    std::fprintf(stderr, "fuzz: a checkpoint's progress was accepted as step %lld, skipped %lld\n",
                 static_cast<long long>(state.next_step), static_cast<long long>(state.skipped));
    std::abort();
  }
  for (const auto& [name, dict] : progress.scalers) {
    ampx::GradScaler scaler;
    scaler.load_state_dict(dict);
    check_scale(scaler);
  }
}

// ampx::load_state_dict (files from Python's torch.save), then a
// GradScaler loading what it returned.
void state_dict(const uint8_t* data, size_t size) {
  const std::string path = scratch_file("state.pt");
  write_file(path, data, size);
  const ampx::StateDict dict = ampx::load_state_dict(path);
  ampx::GradScaler scaler;
  scaler.load_state_dict(dict);
  check_scale(scaler);
}

// ampx::read_safetensors_contents and read_safetensors (weights from Hugging
// Face and other frameworks, FP8 ones with their scales), then the tensors
// into a module: whatever they accept is backed by the file (no tensor bytes
// beyond its size).
void safetensors(const uint8_t* data, size_t size) {
  const std::string path = scratch_file("weights.safetensors");
  write_file(path, data, size);
  const auto contents = ampx::read_safetensors_contents(path);
  size_t bytes = 0;
  for (const auto& [name, t] : contents.tensors) bytes += static_cast<size_t>(t.nbytes());
  for (const auto& [name, t] : contents.fp8) {
    bytes += static_cast<size_t>(t.codes.nbytes());
    (void)t.dequantize();  // whatever codes and scale: values, no crash
  }
  if (bytes > size) {
    std::fprintf(stderr,
                 "fuzz: read_safetensors_contents made %zu tensor bytes from a %zu-byte file\n",
                 bytes, size);
    std::abort();
  }
  // The plain reader accepts the same files, but FP8 ones where LibTorch has
  // no float8 dtype (1.13), which it refuses.
  try {
    ampx::read_safetensors(path);
  } catch (const c10::Error&) {
    if (AMPX_HAS_TORCH_FLOAT8 || contents.fp8.empty()) throw;
  }
  torch::nn::Linear model(4, 3);
  try {
    ampx::load_safetensors(*model, path);
  } catch (const c10::Error&) {
    // names or shapes that are not the model's: refused, as they should be
  }
}

// ampx::plan::load_plan (a precision plan, a file users edit by hand): what
// it accepts saves back and loads again to the same plan, and applies to a
// model or is refused naming the module.
void plan_file(const uint8_t* data, size_t size) {
  const std::string path = scratch_file("plan.json");
  write_file(path, data, size);
  const auto plan = ampx::plan::load_plan(path);
  const std::string again = scratch_file("plan-again.json");
  ampx::plan::save_plan(plan, again);
  const auto reloaded = ampx::plan::load_plan(again);
  if (reloaded.layers.size() != plan.layers.size() || reloaded.target != plan.target) {
    std::fprintf(stderr, "fuzz: a loaded plan saved and loaded again differs\n");
    std::abort();
  }
  torch::nn::Sequential model(torch::nn::Linear(16, 16), torch::nn::Linear(16, 16));
  try {
    (void)ampx::plan::apply_plan(*model, plan);
  } catch (const c10::Error&) {
    // a module the model lacks: refused, as it should be
  }
}

/// The ZeroRedundancyOptimizer the zero_shard target loads into: AdamW over
/// a Linear(4, 3) (one fp32 space of 15 values), on a group of one rank.
ampx::dist::ZeroRedundancyOptimizer make_zero(ampx::dist::ProcessGroup group,
                                              std::vector<torch::Tensor> params) {
  return ampx::dist::ZeroRedundancyOptimizer(
      std::move(params), std::move(group), [](std::vector<torch::Tensor> shard) {
        return std::make_unique<torch::optim::AdamW>(shard, torch::optim::AdamWOptions(1e-3));
      });
}

ampx::dist::ProcessGroup group_of_one() {
  ampx::dist::LaunchEnv env;
  env.master_addr = "127.0.0.1";
  return ampx::dist::init_process_group(
      env,
      ampx::dist::InitOptions().store_file(scratch_file(
          ("store-" + std::to_string(::getpid()) + "-" + std::to_string(std::rand())).c_str())));
}

// ZeroRedundancyOptimizer's per-rank state as a user reads it back:
// ampx::load_archive (the file checked before LibTorch reads it), then
// ZeroRedundancyOptimizer::load, which checks rank, world size and layout.
void zero_shard(const uint8_t* data, size_t size) {
  const std::string path = scratch_file("zero.pt");
  write_file(path, data, size);
  torch::serialize::InputArchive archive;
  ampx::load_archive(archive, path);
  // One group and optimizer per process (each fuzzed input runs in a child
  // of its own; replays share them, and load changes nothing it refuses).
  static torch::nn::Linear model = [] {
    torch::manual_seed(0);
    return torch::nn::Linear(4, 3);
  }();
  static auto zero = make_zero(group_of_one(), model->parameters());
  zero.load(archive);
}

// IDX image + label files. Input: u16 little-endian length of the images
// file, the images file, the labels file.
void idx(const uint8_t* data, size_t size) {
  if (size < 2) return;
  const size_t n = std::min<size_t>(size - 2, data[0] | (data[1] << 8));
  const std::string images = scratch_file("images-idx3-ubyte");
  const std::string labels = scratch_file("labels-idx1-ubyte");
  write_file(images, data + 2, n);
  write_file(labels, data + 2 + n, size - 2 - n);
  (void)ampx::train::read_idx(images, labels);
}

// The text dataset reader (byte tokens, train/val split).
void text(const uint8_t* data, size_t size) {
  const std::string path = scratch_file("data.txt");
  write_file(path, data, size);
  (void)ampx::train::load_text(path);
}

// The launcher-environment parser: lines of NAME=VALUE set for one call.
void launch_env(const uint8_t* data, size_t size) {
  static const char* const kNames[] = {"RANK",
                                       "WORLD_SIZE",
                                       "LOCAL_RANK",
                                       "MASTER_ADDR",
                                       "MASTER_PORT",
                                       "TORCHELASTIC_USE_AGENT_STORE",
                                       "TORCHELASTIC_RESTART_COUNT",
                                       "OMPI_COMM_WORLD_RANK",
                                       "OMPI_COMM_WORLD_SIZE",
                                       "OMPI_COMM_WORLD_LOCAL_RANK",
                                       "SLURM_PROCID",
                                       "SLURM_NTASKS",
                                       "SLURM_LOCALID"};
  for (const char* name : kNames) ::unsetenv(name);
  std::istringstream lines(std::string(reinterpret_cast<const char*>(data), size));
  for (std::string line; std::getline(lines, line);) {
    const auto eq = line.find('=');
    if (eq == std::string::npos || eq == 0) continue;
    const std::string name = line.substr(0, eq);
    if (name.find('\0') != std::string::npos) continue;
    ::setenv(name.c_str(), line.substr(eq + 1).c_str(), 1);  // (a NUL cuts the value short)
  }
  const auto env = ampx::dist::launch_env_from_environment();
  if (!(env.rank >= 0 && env.rank < env.world_size && env.world_size >= 1 && env.master_port >= 1 &&
        env.master_port <= 65535)) {
    std::fprintf(stderr, "fuzz: launch environment accepted rank %lld of %lld, port %lld\n",
                 static_cast<long long>(env.rank), static_cast<long long>(env.world_size),
                 static_cast<long long>(env.master_port));
    std::abort();
  }
}

}  // namespace

const std::vector<NamedTarget>& targets() {
  static const std::vector<NamedTarget> all = {
      {"checkpoint", checkpoint, "ampx-train's checkpoint reader (read_checkpoint + archive)"},
      {"checkpoint_crc", checkpoint_crc, "the checkpoint reader on inputs given a valid CRC-32",
       "checkpoint"},  // the checkpoint seeds, their CRC-32 recomputed after each mutation
      {"checkpoint_state", checkpoint_state,
       "a checkpoint's progress and loss-scaler JSON (read_progress), into GradScalers"},
      {"state_dict", state_dict, "ampx::load_state_dict of torch.save files, into a GradScaler"},
      {"zero_shard", zero_shard,
       "ZeroRedundancyOptimizer's per-rank state: ampx::load_archive, then load"},
      {"fsdp_shard", fsdp_shard,
       "FullyShardedDataParallel's shard: ampx::load_archive, then load_shards"},
      {"train_shard", train_shard,
       "ampx-train's shard file, CRC-32 recomputed: read_shard_file, then load_shards"},
      {"optim_state", optim_state,
       "ampx::optim's state (8-bit moments, Kahan): ampx::load_archive, then load"},
      {"idx", idx, "ampx-train's IDX image/label reader (read_idx)"},
      {"text", text, "ampx-train's text dataset reader (load_text)"},
      {"launch_env", launch_env, "ampx::dist::launch_env_from_environment"},
      {"safetensors", safetensors,
       "ampx::read_safetensors_contents, read_safetensors and load_safetensors"},
      {"plan_file", plan_file, "ampx::plan::load_plan (precision plans, edited by hand)"},
  };
  return all;
}

namespace {

std::string be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

/// checkpoint's, checkpoint_state's and state_dict's seeds: a checkpoint, a
/// resume's description, a GradScaler's state.
std::vector<Seed> checkpoint_seeds() {
  std::vector<Seed> seeds;
  {  // a checkpoint: the trainer's framing around a LibTorch archive of one small tensor
    torch::serialize::OutputArchive archive;
    archive.write("w", torch::arange(4, torch::kFloat));
    std::ostringstream payload;
    archive.save_to(payload);
    const nlohmann::json meta = {
        {"run", {{"workload", "gpt"}}}, {"step", 3}, {"amp", {{"scaler0", {{"scale", 65536.0}}}}}};
    const std::string path = scratch_file("seed.ampx");
    ampx::train::write_checkpoint(path, meta, payload.str());
    seeds.push_back({"checkpoint", "seed-1.ampx", read_whole(path)});
  }
  {  // a description as a resume reads it: two steps, one skipped (its loss NaN), a scaler
    ampx::GradScaler scaler(ampx::GradScalerOptions().init_scale(1024.0).growth_interval(100));
    const nlohmann::json meta = {
        {"run", {{"workload", "gpt"}}},
        {"step", 2},
        {"skipped", 1},
        {"losses", {2.5, std::numeric_limits<double>::quiet_NaN()}},
        {"amp", {{"scaler0", ampx::train::state_dict_to_json(scaler.state_dict())}}}};
    const std::string path = scratch_file("seed-state.ampx");
    ampx::train::write_checkpoint(path, meta, "");
    seeds.push_back({"checkpoint_state", "seed-1.ampx", read_whole(path)});
  }
  {  // a GradScaler state as torch.save writes it
    const std::string path = scratch_file("seed.pt");
    ampx::save_state_dict(ampx::GradScaler().state_dict(), path);
    seeds.push_back({"state_dict", "seed-1.pt", read_whole(path)});
  }
  return seeds;
}

/// safetensors' and plan_file's seeds: the target's model (a Linear(4, 3)) in
/// fp32 and with an E4M3 weight, and a precision plan of it.
std::vector<Seed> model_file_seeds() {
  std::vector<Seed> seeds;
  {  // a safetensors file of a Linear(4, 3), as the target's model
    torch::manual_seed(0);
    torch::nn::Linear model(4, 3);
    const std::string path = scratch_file("seed.safetensors");
    ampx::save_safetensors(*model, path, {{"format", "pt"}});
    seeds.push_back({"safetensors", "seed-1.safetensors", read_whole(path)});
    // The same Linear with its weight in E4M3 and its scale ("weight_scale").
    ampx::SafetensorsContents fp8;
    fp8.fp8["weight"] = ampx::fp8::Fp8Tensor::quantize(
        model->weight.detach(), ampx::fp8::Fp8Format::kE4M3, torch::full({1}, 300.0f));
    fp8.tensors["bias"] = model->bias.detach();
    fp8.metadata["format"] = "pt";
    ampx::save_safetensors(fp8, path);
    seeds.push_back({"safetensors", "seed-fp8.safetensors", read_whole(path)});
  }
  {  // a precision plan of the target's model: one layer in NVFP4, one in bf16
    ampx::plan::PrecisionPlan plan;
    plan.target = "b200";
    plan.loss_budget = 0.005;
    plan.predicted_loss_change = 0.001;
    plan.cost = 0.625;
    plan.layers.push_back({"0", ampx::plan::LayerFormat::kNvfp4,
                           ampx::plan::scale_rule_of(ampx::plan::LayerFormat::kNvfp4), 0.001,
                           0.08, 0.5, "the fastest format measured that b200 runs"});
    plan.layers.push_back({"1", ampx::plan::LayerFormat::kBFloat16,
                           ampx::plan::scale_rule_of(ampx::plan::LayerFormat::kBFloat16), 0, 0,
                           0.5, "every narrower format would leave the budget"});
    const std::string path = scratch_file("seed-plan.json");
    ampx::plan::save_plan(plan, path);
    seeds.push_back({"plan_file", "seed-1.json", read_whole(path)});
  }
  return seeds;
}

/// zero_shard's seed: a ZeroRedundancyOptimizer shard after one AdamW step
/// (the target's model and group).
std::vector<Seed> zero_seeds() {
  torch::manual_seed(0);
  torch::nn::Linear model(4, 3);
  auto zero = make_zero(group_of_one(), model->parameters());
  model->forward(torch::ones({2, 4})).sum().backward();
  zero.step();
  torch::serialize::OutputArchive archive;
  zero.save(archive);
  const std::string path = scratch_file("seed-zero.pt");
  ampx::save_archive(archive, path);
  return {{"zero_shard", "seed-1.pt", read_whole(path)}};
}

/// idx's, text's and launch_env's seeds, written out by hand.
std::vector<Seed> handmade_seeds() {
  // two 2x3 images and their labels
  const std::string images = be32(0x803) + be32(2) + be32(2) + be32(3) + std::string(12, '\x7f');
  const std::string labels = be32(0x801) + be32(2) + std::string("\x03\x09", 2);
  const std::string len = {static_cast<char>(images.size() & 0xff),
                           static_cast<char>(images.size() >> 8)};
  return {
      {"idx", "seed-1.bin", len + images + labels},
      {"text", "seed-1.txt", "Call me Ishmael. Some years ago - never mind how long precisely.\n"},
      {"launch_env", "seed-torchrun.txt",
       "RANK=1\nWORLD_SIZE=2\nLOCAL_RANK=1\nMASTER_ADDR=127.0.0.1\nMASTER_PORT=29500\n"},
      {"launch_env", "seed-slurm.txt",
       "SLURM_PROCID=0\nSLURM_NTASKS=4\nSLURM_LOCALID=0\nMASTER_ADDR=node1\nMASTER_PORT=1234\n"},
      {"launch_env", "seed-mpi.txt",
       "OMPI_COMM_WORLD_RANK=2\nOMPI_COMM_WORLD_SIZE=3\nMASTER_ADDR=::1\nMASTER_PORT=80\n"},
  };
}

}  // namespace

void write_seeds(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::vector<std::vector<Seed>> groups = {checkpoint_seeds(), model_file_seeds(),
                                                 zero_seeds(),       shard_seeds(),
                                                 optim_seeds(),      handmade_seeds()};
  for (const auto& seeds : groups) {
    for (const auto& seed : seeds) {
      fs::create_directories(fs::path(dir) / seed.target);
      const auto path = (fs::path(dir) / seed.target / seed.name).string();
      write_file(path, reinterpret_cast<const uint8_t*>(seed.bytes.data()), seed.bytes.size());
    }
  }
}

std::string scratch_file(const char* name) {
  static const std::string dir = [] {
    const char* base = std::getenv("AMPX_FUZZ_SCRATCH");
    std::string pattern =
        std::string(base ? base : (::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp")) +
        "/ampx-fuzz-XXXXXX";
    TORCH_CHECK(::mkdtemp(pattern.data()) != nullptr, "fuzz: mkdtemp failed for ", pattern);
    return pattern;
  }();
  return dir + "/" + name;
}

}  // namespace ampx::fuzz
