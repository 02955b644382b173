#pragma once

// ampx-train's settings: parsed from the command line (CLI11), completed
// with per-workload defaults, and printed as a table when a run starts.
//
//   TrainConfig config;
//   if (auto code = parse_command_line(argc, argv, config)) return *code;  // --help, bad flags
//   resolve_defaults(config);
//   std::cout << settings_table(config);

#include <ampx/ampx.h>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ampx::train {

/// Every flag of ampx-train. Zero / empty means "the workload's default",
/// filled in by resolve_defaults().
struct TrainConfig {
  std::string workload = "gpt";      // gpt | gpt-nn | mnist-cnn | fashion-mlp
  std::string precision = "O2";      // fp32 | O1 | O2 | O3 | fp8 | mxfp8 | nvfp4 | fp8-block | auto
  std::vector<std::string> compare;  // modes to train one after another
  std::string dtype;                 // bf16 | fp16; default bf16 on CPU, fp16 on CUDA
  std::string device = "cpu";        // cpu | cuda
  int nproc = 1;  // data-parallel processes started here (torchrun sets WORLD_SIZE instead)
  std::string shard = "none";  // none | optimizer | grad | full (sharding.h)
  int threads = 0;            // intra-op threads; 0: this host's cores / its processes
  std::string malloc = "keep";  // keep: ampx::keep_freed_cpu_memory() | default: glibc's own
  int memory_origins = 0;     // --memory-origins N: each mode's peak by origin, its N largest (CPU)
  double dist_timeout = 300;  // --dist-timeout: seconds a rendezvous or collective may take
  int64_t batch_size = 0;     // per step
  int64_t steps = 0;          // optimizer steps (or --epochs)
  double epochs = 0;          // passes over the training split
  double lr = 0;              // AdamW learning rate
  double weight_decay = 0.01;
  std::string masters;                   // --masters fp32|kahan|stochastic; "": the mode's
  std::string optimizer_state = "fp32";  // --optimizer-state fp32|bf16|fp8|8bit
  double init_scale = 0;                 // --init-scale: the loss scaler's first scale; 0: 65536
  int64_t growth_interval = 0;           // --growth-interval: its steps between growths; 0: 2000
  uint64_t seed = 1337;
  bool tf32 = false;  // --tf32: TF32 fp32 products and convolutions (CUDA)
  // gpt model shape
  int64_t block_size = 128;
  int64_t layers = 4;
  int64_t d_model = 256;
  int64_t heads = 4;
  std::string gpt_shape;  // --gpt-shape gpt2-small: GPT-2 small's shape (12 x 768, 12 heads, 1024)
  std::string attention = "fused";  // --attention fused|explicit (gpt, CPU)
  std::string recompute = "none";   // --recompute none|mlp|blocks (gpt, gpt-nn)
  // files
  std::string data_dir;        // --data-dir, $AMPX_DATA_DIR, ~/.cache/ampx/data
  std::string out_dir;         // metrics, tables, plot; default runs/<workload>
  std::string checkpoint_dir;  // default <out-dir>/checkpoints
  int64_t save_every = 0;      // steps between checkpoints; 0: none
  bool resume = false;
  std::string export_weights;  // --export-weights PATH: the trained weights as safetensors
  // reporting
  int64_t eval_every = 0;                // steps between held-out evaluations; 0: at the end only
  int64_t eval_batches = 0;              // gpt: held-out batches per evaluation
  int64_t log_every = 0;                 // plain progress lines; 0: about 20 per run
  std::string metrics_format = "jsonl";  // jsonl | csv
  std::string progress = "auto";         // auto | bar | lines | none
  std::string profile;                   // Chrome trace of one step after warm-up
  // numerics diagnostics (ampx::debug, docs/numerics.md)
  std::string detect_nonfinite;  // --detect-nonfinite[=throw|warn]; "": off
  bool diagnose = false;         // --diagnose: fp32 steps under range statistics, then advice
  int64_t diagnose_steps = 4;    // --diagnose-steps
  bool range_stats = false;      // --range-stats: collect while training, write the JSON
  // FP8 (mode fp8: O1 plus FP8 Linears; docs/fp8.md)
  std::string fp8_recipe = "delayed";  // delayed | current
  std::string fp8_format = "hybrid";   // hybrid | e4m3
  int64_t amax_history = 1024;         // delayed scaling's history length
  std::string fp8_trace_layer;         // the layer whose amax/scale the report plots; "": first
  std::string bf16_layers = "auto";    // FP8 modes: Linears kept in bf16 (paths, prefixes, none, auto)
  std::string fp8_tail = "0";          // FP8 modes: the last steps' share without FP8 (--dtype)
  // --precision auto (ampx/precision_plan.h, docs/numerics.md)
  std::string loss_budget = "0.5%";  // --loss-budget: the plan's largest predicted loss change
  std::string target = "b200";       // --target h100|b200|cpu: whose throughput the plan models
  std::string precision_plan;        // --precision-plan FILE: apply this plan (no measurement)
  int64_t plan_steps = 4;            // --plan-steps: training steps of each measurement probe
  std::string plan_reference = "bf16";  // --plan-reference bf16|fp32: what the budget is against
  std::string plan_tail = "10%";  // --plan-tail: the last steps' share in the reference format
  bool plan_tail_given = false;   // --plan-tail was on the command line (a saved plan has its own)
  std::string plan_ends = "fp8";  // --plan-ends: the floor of the first and last blocks, or none
  bool plan_ends_given = false;   // --plan-ends was on the command line (a saved plan has its own)
  int64_t plan_watch = -1;  // --plan-watch N: check every N steps; 0 off; -1: 50 under auto
  bool plan_widen = false;  // --plan-widen: move a layer the watch reports to a wider format
  double plan_noise_ratio = 1.7320508075688772;  // --plan-noise-ratio: the watch's threshold
  // Set by a --compare run on the processes it starts, one per mode, so that
  // every mode is measured in a fresh process (hidden flags).
  std::string only_mode;    // --only-mode: train this mode of --compare
  std::string result_file;  // --result-file: write the RunResult as JSON

  bool on_cuda() const { return device == "cuda"; }
  /// `device` as LibTorch names it.
  torch::Device torch_device() const { return on_cuda() ? torch::kCUDA : torch::kCPU; }
};

/// The attention path a GPT workload's model runs (settings and report).
const char* gpt_attention_of(const TrainConfig& config);
/// What --recompute runs again in backward, for the settings table.
std::string recompute_description(const TrainConfig& config);

/// Whether `workload` trains a GPT on Moby Dick's text (gpt, gpt-nn).
inline bool is_gpt_workload(const std::string& workload) {
  return workload == "gpt" || workload == "gpt-nn";
}

/// Parses argv into `config`. Returns an exit code when the program should
/// stop (0 after --help, CLI11's code after a usage error, printed to
/// stderr), nullopt when it should run.
std::optional<int> parse_command_line(int argc, const char* const* argv, TrainConfig& config);

/// Fills in workload defaults (batch size, steps, lr), the dtype for the
/// device, the thread count, the folders; checks combinations that CLI11
/// cannot (fp16 on a 1.13 CPU, CUDA without a device, ...). Throws
/// c10::Error naming the flag and value.
void resolve_defaults(TrainConfig& config);

/// The precision modes this run trains: --compare's list (repeats dropped),
/// or --precision; just --only-mode in a process a --compare run started.
std::vector<std::string> modes_of(const TrainConfig& config);

/// A precision mode, typed: ampx's opt level and the low-precision dtype.
/// fp32 is O0 in fp32; O1, O2 and O3 train in --dtype.
///
///   Mode m = parse_mode("O2", config);  // {"O2", OptLevel::O2, kBFloat16} on CPU
struct Mode {
  std::string name = "fp32";  // fp32 | O1 | O2 | O3 | an FP8 mode: file names, tables, checkpoints
  std::string precision = "fp32";  // name without its "+" parts: "O2" of "O2+8bit"
  /// From the name's "+" parts (fp32, O1, O2, O3): --masters (kahan,
  /// stochastic) and --optimizer-state (bf16, fp8, 8bit) for this mode
  /// alone, so that --compare can set them side by side ("": the flags').
  std::string masters, optimizer_state;
  ampx::OptLevel level = ampx::OptLevel::O0;
  c10::ScalarType dtype = c10::kFloat;  // the low precision (fp32: kFloat)
  bool fp8 = false;  // fp8, mxfp8, nvfp4, fp8-block, auto: O1 with the Linears in FP8 (or FP4)

  bool mixed() const { return level != ampx::OptLevel::O0; }
  /// "fp32", "bf16" or "fp16".
  std::string dtype_name() const;
};

/// The mode `name` (fp32, O1, O2, O3 or an FP8 mode) in config.dtype; fp32,
/// O1, O2 and O3 may end in "+" parts, each a masters or an optimizer
/// state ("O2+8bit", "O3+kahan+fp8": Mode::masters, optimizer_state).
/// Throws c10::Error naming the modes for any other name.
Mode parse_mode(const std::string& name, const TrainConfig& config);

/// The precision of mode name `name`: "O2" of "O2+8bit".
std::string precision_of(const std::string& name);

/// Whether `name` is an FP8 mode: fp8 (tensorwise scales), mxfp8, nvfp4,
/// fp8-block, or auto (each Linear in the format of a plan).
bool is_fp8_mode(const std::string& name);

/// The recipe of FP8 mode `mode`: for fp8 the one --fp8-recipe, --fp8-format
/// and --amax-history ask for; TE's block recipes for the others (NVFP4's
/// stochastic rounding seeded by --seed).
ampx::fp8::Recipe fp8_recipe_of(const TrainConfig& config, const std::string& mode);

/// Two columns, one setting a line, for the start of a run.
std::string settings_table(const TrainConfig& config);

}  // namespace ampx::train
