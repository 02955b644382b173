#include "config.h"

#include "config_checks.h"

#include "distributed/sharding.h"
#include "gpt_nn.h"
#include "models.h"
#include "run/data.h"
#include "run/optimizer_options.h"

#include <ampx/dist.h>

#include <c10/util/Exception.h>
#include <CLI/CLI.hpp>

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <thread>

namespace ampx::train {
namespace {

const std::vector<std::string> kWorkloads = {"gpt", "gpt-nn", "mnist-cnn", "fashion-mlp"};
const std::vector<std::string> kModes = {"fp32",  "O1",    "O2",        "O3",  "fp8",
                                         "mxfp8", "nvfp4", "fp8-block", "auto"};

/// --compare's and --only-mode's check: a mode, "+" parts allowed (parse_mode).
CLI::Validator mode_name_check() {
  return CLI::Validator(
      [](std::string& name) -> std::string {
        try {
          (void)parse_mode(name, TrainConfig());
          return "";
        } catch (const c10::Error& e) {
          return e.what_without_backtrace();
        }
      },
      "MODE[+MASTERS][+STATE]");
}

struct WorkloadDefaults {
  int64_t batch_size;
  int64_t steps;  // 0: use epochs
  double epochs;
  double lr;
};

WorkloadDefaults defaults_of(const std::string& workload) {
  if (is_gpt_workload(workload)) return {32, 200, 0, 1e-3};
  if (workload == "mnist-cnn") return {128, 0, 1, 1e-3};
  return {256, 0, 3, 1e-3};  // fashion-mlp
}

// CLI11's PositiveNumber reports "Value 0 not in range 0.000000 to <300
// digits>"; this one says what is wrong.
const CLI::Validator kPositive(
    [](std::string& text) -> std::string {
      double v = 0;
      try {
        v = std::stod(text);
      } catch (const std::exception&) {
        return "must be a number > 0 (got '" + text + "')";
      }
      return v > 0 ? std::string() : "must be > 0 (got " + text + ")";
    },
    "POSITIVE");

/// The cores this process may run on (its affinity: taskset, cgroup
/// cpusets, a batch system's binding), else all online ones.
int cores_available() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

/// The processes of this run on this host: the launcher's local world size
/// (LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, Slurm's tasks per node),
/// or --nproc.
int local_processes(int nproc) {
  if (!ampx::dist::launched_as_rank()) return nproc;
  try {
    return static_cast<int>(
        std::max<int64_t>(1, ampx::dist::launch_env_from_environment().local_world_size));
  } catch (const c10::Error&) {
    return 1;  // the incomplete environment is reported when the ranks meet
  }
}

// What to train, in which precision modes, on which device.
void add_mode_options(CLI::App& app, TrainConfig& c) {
  app.add_option("--workload", c.workload,
                 "what to train: gpt (char transformer on Moby Dick), gpt-nn (the same GPT "
                 "built from torch::nn's stock modules: MultiheadAttention, GELU, Sequential), "
                 "mnist-cnn (MNIST), fashion-mlp (Fashion-MNIST)")
      ->check(CLI::IsMember(kWorkloads));
  auto* precision = app.add_option("--precision", c.precision,
                                   "precision mode of a single run: fp32, O1 (autocast), O2 (low-"
                                   "precision weights, fp32 masters and norms), O3 (pure low "
                                   "precision, stochastic rounding), fp8 (O1 with FP8 Linears, "
                                   "tensorwise scales), mxfp8, nvfp4, fp8-block (O1 with "
                                   "block-scaled Linears: TE's recipes, emulated on the CPU), auto (O1 "
                                   "with each Linear in the format a measured plan gives it: "
                                   "--loss-budget, --target, --precision-plan)")
                        ->check(CLI::IsMember(kModes));
  app.add_option("--compare", c.compare,
                 "train once per listed mode from the same seed and compare, e.g. fp32,O1,O2; "
                 "fp32, O1, O2 and O3 may add +kahan or +stochastic masters and a +bf16, +fp8 or "
                 "+8bit optimizer state, e.g. O2,O2+8bit,O3+kahan+8bit")
      ->delimiter(',')
      ->check(mode_name_check())
      ->excludes(precision);
  app.add_option("--dtype", c.dtype,
                 "16-bit type of the mixed modes: bf16 or fp16 "
                 "[default: bf16 on cpu, fp16 on cuda]")
      ->check(CLI::IsMember({"bf16", "fp16"}))
      ->default_str("auto");
  app.add_option("--device", c.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("--tf32", c.tf32,
               "--device cuda: TF32 tensor-core math for fp32 matrix products and convolutions "
               "(Ampere and later), in every mode; off: LibTorch's defaults (products in fp32)");
}

// Processes, threads and memory.
void add_process_options(CLI::App& app, TrainConfig& c) {
  app.add_option("--nproc", c.nproc,
                 "data-parallel processes on this machine (Gloo); --batch-size is the global "
                 "batch, split across them. Under torchrun, its WORLD_SIZE decides instead")
      ->check(kPositive);
  add_shard_option(app, c);
  add_optimizer_options(app, c);
  app.add_option("--dist-timeout", c.dist_timeout,
                 "seconds the ranks' rendezvous and each collective may take before the run "
                 "fails naming the ranks that stopped answering")
      ->check(kPositive);
  app.add_option("--threads", c.threads,
                 "intra-op CPU threads [default: this host's cores / its processes of the run]")
      ->check(kPositive)
      ->default_str("auto");
  app.add_option("--malloc", c.malloc,
                 "keep: glibc's malloc keeps freed memory for the next step "
                 "(ampx::keep_freed_cpu_memory: no page faults re-taking activations); "
                 "default: glibc's thresholds, which hand it back to the kernel")
      ->check(CLI::IsMember({"keep", "default"}))
      ->capture_default_str();
  app.add_option("--memory-origins", c.memory_origins,
                 "N > 0: where each mode's peak memory came from, its N largest origins (the "
                 "step's phase and the op that allocated; ampx::peak_cpu_memory_origins), "
                 "after the results and in compare.json; CPU only, a diagnostic (slower steps)")
      ->check(CLI::NonNegativeNumber);
}

// The optimization: batches, length, AdamW, seed.
void add_schedule_options(CLI::App& app, TrainConfig& c) {
  app.add_option("--batch-size", c.batch_size,
                 "samples (gpt: sequences) per step [default: gpt 32, mnist-cnn 128, "
                 "fashion-mlp 256]")
      ->check(kPositive)
      ->default_str("auto");
  auto* steps = app.add_option("--steps", c.steps,
                               "optimizer steps [default: gpt 200; image workloads use --epochs]")
                    ->check(kPositive)
                    ->default_str("auto");
  app.add_option("--epochs", c.epochs,
                 "passes over the training split [default: mnist-cnn 1, fashion-mlp 3]")
      ->check(kPositive)
      ->excludes(steps)
      ->default_str("auto");
  app.add_option("--lr", c.lr, "AdamW learning rate [default: 1e-3]")
      ->check(kPositive)
      ->default_str("auto");
  app.add_option("--weight-decay", c.weight_decay, "AdamW decoupled weight decay")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--seed", c.seed, "seed of the weights, the data order and stochastic rounding");
}

// The gpt workloads' shape and attention.
void add_gpt_options(CLI::App& app, TrainConfig& c) {
  auto* block = app.add_option("--block-size", c.block_size, "gpt: context length in characters")
                    ->check(CLI::Range(int64_t{2}, int64_t{4096}));
  auto* layers = app.add_option("--layers", c.layers, "gpt: transformer blocks")
                     ->check(CLI::Range(int64_t{1}, int64_t{64}));
  auto* width = app.add_option("--d-model", c.d_model, "gpt: width")
                    ->check(CLI::Range(int64_t{8}, int64_t{8192}));
  auto* heads = app.add_option("--heads", c.heads, "gpt: attention heads (must divide --d-model)")
                    ->check(kPositive);
  app.add_option("--gpt-shape", c.gpt_shape,
                 "gpt: a named shape instead of the four above: gpt2-small (12 layers, d 768, "
                 "12 heads, context 1024: GPT-2 small's, for GPUs)")
      ->check(CLI::IsMember({"gpt2-small"}))
      ->excludes(block)
      ->excludes(layers)
      ->excludes(width)
      ->excludes(heads);
  app.add_option("--attention", c.attention,
                 "gpt on the CPU: fused (ampx::scaled_dot_product_attention, one kernel each "
                 "way) or explicit (matmul, masked_fill, softmax, matmul: the ops of the Python "
                 "comparison's model)")
      ->check(CLI::IsMember({"fused", "explicit"}));
  app.add_option("--recompute", c.recompute,
                 "gpt, gpt-nn: activation checkpointing (ampx::checkpoint): none; mlp (GELU's "
                 "output is not kept: GELU runs again in backward, and the MLP's output "
                 "product too unless O2 multiplies wide); blocks (whole blocks run again, only "
                 "their inputs are kept). The "
                 "same gradients, less memory, more compute")
      ->check(CLI::IsMember({"none", "mlp", "blocks"}));
}

// Data, outputs, checkpoints, evaluation and progress.
void add_output_options(CLI::App& app, TrainConfig& c) {
  app.add_option("--data-dir", c.data_dir,
                 "datasets folder [default: $AMPX_DATA_DIR, else ~/.cache/ampx/data]; "
                 "filled by scripts/install-data.sh");
  app.add_option("--out-dir", c.out_dir,
                 "metrics, comparison table and plot [default: runs/<workload>]");
  app.add_option("--checkpoint-dir", c.checkpoint_dir,
                 "checkpoints [default: <out-dir>/checkpoints]");
  app.add_option("--save-every", c.save_every, "write a checkpoint every N steps (0: never)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--resume", c.resume, "continue from the checkpoint in --checkpoint-dir");
  app.add_option("--export-weights", c.export_weights,
                 "after training, write the model's weights to this safetensors file "
                 "(Python: safetensors.torch.load_model): the fp32 master weights where the "
                 "mode keeps them (O2), the weights as trained otherwise (fp32, O1, fp8: "
                 "fp32; O3: bf16/fp16), and the model's buffers; with --compare, one file "
                 "per mode: PATH-<mode>.safetensors");
  app.add_option("--eval-every", c.eval_every,
                 "evaluate on the held-out split every N steps (0: at the end only)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--eval-batches", c.eval_batches,
                 "gpt: held-out batches per evaluation [default: 32]")
      ->check(CLI::NonNegativeNumber)
      ->default_str("auto");
  app.add_option("--log-every", c.log_every,
                 "steps between progress lines when not on a terminal [default: ~20 per run]")
      ->check(CLI::NonNegativeNumber)
      ->default_str("auto");
  app.add_option("--metrics-format", c.metrics_format, "per-step metrics file: jsonl or csv")
      ->check(CLI::IsMember({"jsonl", "csv"}));
  app.add_option("--progress", c.progress,
                 "auto (a live line on a terminal, plain lines otherwise), bar, lines, none")
      ->check(CLI::IsMember({"auto", "bar", "lines", "none"}));
  app.add_option("--profile", c.profile,
                 "profile one step after warm-up: a Chrome trace to this file (with --compare, "
                 "one per mode: FILE-<mode>.json) and the ops taking the most time on the console");
}

// Numerics diagnostics (ampx::debug; docs/numerics.md).
void add_diagnostic_options(CLI::App& app, TrainConfig& c) {
  auto* detect =
      app.add_flag("--detect-nonfinite{throw}", c.detect_nonfinite,
                   "check every op's output in each step's forward and backward for inf/NaN: "
                   "=throw (the default) stops at the first with a report naming the op, the "
                   "layer and the step (exit status 3); =warn reports and trains on, and the "
                   "summary counts them (suits fp16, whose loss scaler overflows on purpose)")
          ->check(CLI::IsMember({"throw", "warn"}));
  auto* diagnose = app.add_flag("--diagnose", c.diagnose,
                                "train --diagnose-steps fp32 steps under range statistics and "
                                "print which precision fits each layer: <out-dir>/diagnose.md, "
                                ".json and .png (gnuplot)");
  diagnose->excludes("--compare")
      ->excludes("--resume")
      ->excludes("--save-every")
      ->excludes(detect)
      ->excludes("--export-weights");
  app.add_option("--diagnose-steps", c.diagnose_steps, "fp32 steps --diagnose watches")
      ->check(kPositive)
      ->needs(diagnose);
  app.add_flag("--range-stats", c.range_stats,
               "collect range statistics of every layer while training (slow: for diagnosis and "
               "benchmarks) and write them to <out-dir>/range-stats-<mode>.json")
      ->excludes(diagnose);
}

// FP8 (mode fp8; docs/fp8.md).
void add_fp8_options(CLI::App& app, TrainConfig& c) {
  app.add_option("--fp8-recipe", c.fp8_recipe,
                 "fp8 scaling: delayed (TE's DelayedScaling: scales from the amax history) or "
                 "current (each tensor its own amax)")
      ->check(CLI::IsMember({"delayed", "current"}));
  app.add_option("--fp8-format", c.fp8_format,
                 "fp8 formats: hybrid (E4M3 forward, E5M2 gradients) or e4m3 (both passes)")
      ->check(CLI::IsMember({"hybrid", "e4m3"}));
  app.add_option("--amax-history", c.amax_history, "fp8 delayed scaling: amax history length")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--bf16-layers", c.bf16_layers,
                 "mxfp8, nvfp4, fp8-block, fp8: the Linears kept in bf16, comma-separated paths "
                 "or prefixes (blocks.0 keeps blocks.0.*), 'none', or 'auto': nvfp4 keeps the "
                 "first and last blocks and the head (the published choice), the others the head");
  app.add_option("--fp8-tail", c.fp8_tail,
                 "mxfp8, nvfp4, fp8-block, fp8: the share of the run's last steps in which every "
                 "Linear trains in the run's autocast dtype (--dtype), the FP8 region closed "
                 "(NVIDIA's NVFP4 recipe's late switch to bf16; 0: none)")
      ->capture_default_str();
  app.add_option("--loss-budget", c.loss_budget,
                 "--precision auto: the largest loss change the plan may predict, relative "
                 "(0.5% or 0.005)")
      ->capture_default_str();
  app.add_option("--target", c.target,
                 "--precision auto: the hardware whose product throughput per format the plan "
                 "models: h100, b200 (published peak ratios) or cpu (measured here)")
      ->check(CLI::IsMember({"h100", "b200", "cpu"}))
      ->capture_default_str();
  app.add_option("--precision-plan", c.precision_plan,
                 "--precision auto: apply this saved plan (JSON) instead of measuring one");
  app.add_option("--plan-steps", c.plan_steps,
                 "--precision auto: training steps of each measurement probe")
      ->check(kPositive)
      ->capture_default_str();
  app.add_option("--plan-reference", c.plan_reference,
                 "--precision auto: what the loss budget is measured against: bf16 (every "
                 "Linear as O2 runs it) or fp32 (every Linear in float32: bf16 costs budget "
                 "too, and the plan may keep layers in fp32 or fp16)")
      ->check(CLI::IsMember({"bf16", "fp32"}))
      ->capture_default_str();
  app.add_option("--plan-tail", c.plan_tail,
                 "--precision auto: the share of the run's last steps in which every Linear "
                 "trains in the --plan-reference format (NVIDIA's NVFP4 recipe's late switch; "
                 "0: none); kept in the plan file: a --precision-plan (or --resume) run takes the "
                 "plan's own, and refuses another")
      ->capture_default_str();
  app.add_option("--plan-ends", c.plan_ends,
                 "--precision auto: the narrowest format the Linears of the first and last "
                 "blocks may take (their element width: fp8 allows fp8, fp8-block, mxfp8 and "
                 "wider, not nvfp4), by position, as NVIDIA's NVFP4 recipe keeps them; none: no "
                 "floor. Kept in the plan file: a --precision-plan (or --resume) run takes the "
                 "plan's own, and refuses another")
      ->check(CLI::IsMember(
          {"none", "fp32", "fp16", "bf16", "fp8-block", "fp8", "mxfp8", "nvfp4"}))
      ->capture_default_str();
  app.add_option("--plan-watch", c.plan_watch,
                 "--precision auto: check the plan against bf16 every N steps while training "
                 "(a layer whose gradient its format's noise drowns, or whose range flushes it, "
                 "is reported); 0: never [default: 50]")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--plan-noise-ratio", c.plan_noise_ratio,
                 "--precision auto: the watch reports a layer whose gradient norm is below this "
                 "times its format's noise (\"FP4 all the way\": sqrt(3))")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--plan-widen", c.plan_widen,
               "--precision auto: move each layer the watch reports to the next wider format "
               "its --target runs");
  app.add_option("--fp8-trace-layer", c.fp8_trace_layer,
                 "fp8: the layer whose amax and scale the report plots, e.g. blocks.0.fc "
                 "[default: the first FP8 layer]");
}

}  // namespace

std::optional<int> parse_command_line(int argc, const char* const* argv, TrainConfig& c) {
  CLI::App app{
      "ampx-train: trains a reference workload on real data in one or more precision modes\n"
      "and shows what each buys (speed, memory, accuracy). Example:\n"
      "  ampx-train --workload gpt --compare fp32,O1,O2",
      "ampx-train"};
  app.option_defaults()->always_capture_default();
  app.get_formatter()->column_width(34);

  add_mode_options(app, c);
  add_process_options(app, c);
  add_schedule_options(app, c);
  add_gpt_options(app, c);
  add_output_options(app, c);
  add_diagnostic_options(app, c);
  add_fp8_options(app, c);
  // Internal: a --compare run starts one process per mode with these.
  app.add_option("--only-mode", c.only_mode)->check(mode_name_check())->group("");
  app.add_option("--result-file", c.result_file)->group("");
  try {
    app.parse(argc, argv);
    c.plan_tail_given = app.count("--plan-tail") > 0;
    c.plan_ends_given = app.count("--plan-ends") > 0;
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return std::nullopt;
}

void resolve_defaults(TrainConfig& c) {
  const auto d = defaults_of(c.workload);
  if (c.batch_size == 0) c.batch_size = d.batch_size;
  if (c.steps == 0 && c.epochs == 0) {
    c.steps = d.steps;
    c.epochs = d.steps == 0 ? d.epochs : 0;
  }
  if (c.lr == 0) c.lr = d.lr;
  if (c.eval_batches == 0) c.eval_batches = 32;
  if (c.dtype.empty()) c.dtype = c.on_cuda() ? "fp16" : "bf16";
  if (c.threads == 0) c.threads = std::max(1, cores_available() / local_processes(c.nproc));
  if (c.out_dir.empty()) c.out_dir = "runs/" + c.workload;
  if (c.checkpoint_dir.empty()) c.checkpoint_dir = c.out_dir + "/checkpoints";
  c.data_dir = resolve_data_dir(c.data_dir).string();
  if (c.gpt_shape == "gpt2-small") {
    c.layers = 12;
    c.d_model = 768;
    c.heads = 12;
    c.block_size = 1024;
  }
  check_combinations(c);
}

std::vector<std::string> modes_of(const TrainConfig& c) {
  if (!c.only_mode.empty()) return {c.only_mode};
  if (c.compare.empty()) return {c.precision};
  std::vector<std::string> modes;
  for (const auto& m : c.compare) {  // keep the user's order, drop repeats
    if (std::find(modes.begin(), modes.end(), m) == modes.end()) modes.push_back(m);
  }
  return modes;
}

std::string Mode::dtype_name() const {
  return dtype == c10::kHalf ? "fp16" : dtype == c10::kBFloat16 ? "bf16" : "fp32";
}

std::string precision_of(const std::string& name) {
  return name.substr(0, name.find('+'));
}

Mode parse_mode(const std::string& name, const TrainConfig& config) {
  const std::string precision = precision_of(name);
  TORCH_CHECK(std::find(kModes.begin(), kModes.end(), precision) != kModes.end(),
              "ampx-train: unknown precision mode '", name,
              "' (fp32, O1, O2, O3, fp8, mxfp8, nvfp4, fp8-block, auto)");
  Mode mode;
  mode.name = name;
  mode.precision = precision;
  for (size_t at = precision.size(); at < name.size();) {  // name[at] is a "+"
    const size_t end = std::min(name.find('+', at + 1), name.size());
    const std::string part = name.substr(at + 1, end - at - 1);
    at = end;
    const bool masters = part == "kahan" || part == "stochastic";
    TORCH_CHECK(masters || part == "bf16" || part == "fp8" || part == "8bit", "ampx-train: mode '",
                name, "': '", part,
                "' is neither masters (kahan, stochastic) nor an optimizer state (bf16, fp8, "
                "8bit)");
    std::string& slot = masters ? mode.masters : mode.optimizer_state;
    TORCH_CHECK(slot.empty(), "ampx-train: mode '", name, "' gives ",
                masters ? "masters" : "an optimizer state", " twice");
    slot = part;
  }
  TORCH_CHECK(name == precision || !is_fp8_mode(precision), "ampx-train: mode '", name,
              "': ", precision,
              " takes --masters and --optimizer-state as flags, not as \"+\" parts");
  TORCH_CHECK(mode.masters.empty() || precision == "O2" || precision == "O3", "ampx-train: mode '",
              name, "': ", mode.masters, " keeps the lost bits of 16-bit weights, and ", precision,
              " trains none (O2 and O3 do)");
  if (precision == "fp32") return mode;
  mode.fp8 = is_fp8_mode(precision);
  mode.level = mode.fp8 ? ampx::OptLevel::O1 : ampx::parse_opt_level(precision);
  mode.dtype = config.dtype == "fp16" ? c10::kHalf : c10::kBFloat16;
  return mode;
}

bool is_fp8_mode(const std::string& name) {
  return name == "fp8" || name == "mxfp8" || name == "nvfp4" || name == "fp8-block" ||
         name == "auto";
}

ampx::fp8::Recipe fp8_recipe_of(const TrainConfig& c, const std::string& mode) {
  TORCH_CHECK(mode != "auto", "ampx-train: --precision auto has a recipe per layer (its plan)");
  // The block recipes with TE's defaults; NVFP4's stochastic rounding from the run's seed.
  if (mode == "mxfp8") return ampx::fp8::MXFP8BlockScaling();
  if (mode == "nvfp4") return ampx::fp8::NVFP4BlockScaling().seed(static_cast<uint64_t>(c.seed));
  if (mode == "fp8-block") return ampx::fp8::Float8BlockScaling();
  const auto format =
      c.fp8_format == "e4m3" ? ampx::fp8::RecipeFormat::kE4M3 : ampx::fp8::RecipeFormat::kHybrid;
  if (c.fp8_recipe == "current") return ampx::fp8::CurrentScaling().fp8_format(format);
  return ampx::fp8::DelayedScaling().fp8_format(format).amax_history_len(c.amax_history);
}

std::string recompute_description(const TrainConfig& c) {
  if (c.recompute == "mlp") {
    return "mlp: each block's GELU again in backward (O2 with wide products), or GELU and output "
           "product";
  }
  if (c.recompute == "blocks") return "blocks: each block's forward again in backward";
  return "none";
}

const char* gpt_attention_of(const TrainConfig& c) {
  if (c.workload == "gpt-nn") return kGptNNAttention;
  return gpt_attention(torch::Device(c.device), gpt_attention_named(c.attention));
}

}  // namespace ampx::train
