#include "trainer.h"

#include "checkpoint.h"
#include "device_memory.h"
#include "machine.h"
#include "output_file.h"
#include "preemption.h"
#include "profile.h"
#include "progress.h"
#include "rank_agreement.h"
#include "report.h"

#include <ampx/ampx.h>
#include <ampx/debug/nonfinite.h>
#include <ampx/debug/scope.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <mutex>
#include <numeric>
#include <optional>
#include <sstream>

// GCC 14 reports the destructor of summarize_timing's std::vector<double>,
// inlined into train_mode, as freeing a non-heap pointer: a false positive
// inside libstdc++ (GCC 12 and 16 do not report it).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 14
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wfree-nonheap-object"
#define AMPX_TRAINER_GCC14_PUSHED
#endif

namespace ampx::train {
namespace {

namespace fs = std::filesystem;

/// The state a run needs beyond its parameters, for checkpoints.
struct LoopState {
  int64_t next_step = 0;
  int64_t skipped = 0;
  std::vector<double> losses;
};

void save(const std::string& path, const nlohmann::json& identity, const Workload& workload,
          torch::nn::Module& model, torch::optim::Optimizer& opt, const ampx::AmpSession& amp,
          const LoopState& state) {
  torch::serialize::OutputArchive archive, model_archive, opt_archive;
  model.save(model_archive);
  opt.save(opt_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", opt_archive);
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    archive.write("rng/cpu", gen.get_state());
  }
  std::ostringstream payload;
  archive.save_to(payload);
  nlohmann::json amp_state = nlohmann::json::object();
  for (const auto& [name, dict] : amp.state_dict()) amp_state[name] = state_dict_to_json(dict);
  const int64_t spe = workload.steps_per_epoch();
  const nlohmann::json meta = {
      {"format", "ampx-train checkpoint"},
      {"run", identity},
      {"step", state.next_step},
      {"epoch", state.next_step / spe},
      {"position_in_epoch", state.next_step % spe},
      {"skipped", state.skipped},
      {"losses", state.losses},
      {"amp", amp_state},
      {"torch_version", ampx::torch_version()},
  };
  fs::create_directories(fs::path(path).parent_path());
  write_checkpoint(path, meta, payload.str());
}

void load(const std::string& path, const Checkpoint& c, const nlohmann::json& identity,
          torch::nn::Module& model, torch::optim::Optimizer& opt, ampx::AmpSession& amp,
          LoopState& state) {
  check_compatible(path, c.meta.at("run"), identity);
  auto progress = read_progress(path, c);  // checked before anything is restored
  torch::serialize::InputArchive archive, model_archive, opt_archive;
  read_payload(path, c, archive);
  try {
    archive.read("model", model_archive);
    archive.read("optimizer", opt_archive);
    model.load(model_archive);
    opt.load(opt_archive);
    torch::Tensor rng;
    archive.read("rng/cpu", rng);
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "ampx-train: checkpoint '", path,
                "' passed its checks but its content does not fit this model: ",
                e.what_without_backtrace());
  }
  amp.load_state_dict(progress.scalers);
  state.next_step = progress.step;
  state.skipped = progress.skipped;
  state.losses = std::move(progress.losses);
}

std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "ampx-train: cannot open checkpoint '", path, "'");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// FNV-1a (64-bit) of every parameter's bytes in order: equal on ranks
/// whose weights are bitwise equal.
std::string weights_checksum(torch::nn::Module& model) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& p : model.parameters()) {
    const auto c = p.detach().to(torch::kCPU).contiguous();
    const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
    for (int64_t i = 0; i < c.numel() * static_cast<int64_t>(c.element_size()); ++i) {
      h = (h ^ bytes[i]) * 1099511628211ull;
    }
  }
  char text[24];
  std::snprintf(text, sizeof(text), "0x%016llx", static_cast<unsigned long long>(h));
  return text;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

nlohmann::json to_json(const RunResult& r) {
  nlohmann::json evals = nlohmann::json::array();
  for (const auto& [step, e] : r.evals) evals.push_back({step, e.loss, e.metric});
  return {{"mode", r.mode},
          {"dtype", r.dtype},
          {"blas", r.blas},
          {"steps", r.steps},
          {"timed_steps", r.timed_steps},
          {"items_per_s", r.items_per_s},
          {"median_step_ms", r.median_step_ms},
          {"peak_bytes", r.peak_bytes},
          {"train_loss", r.train_loss},
          {"eval", {r.eval.loss, r.eval.metric}},
          {"skipped", r.skipped},
          {"final_scale", r.final_scale},
          {"losses", r.losses},
          {"evals", evals},
          {"metrics_path", r.metrics_path},
          {"fp8_trace_path", r.fp8_trace_path},
          {"checkpoint_path", r.checkpoint_path}};
}

namespace {
// JSON has no NaN (nlohmann writes null): a diverged run's losses come back as NaN.
double number(const nlohmann::json& j) {
  return j.is_null() ? NAN : j.get<double>();
}
}  // namespace

RunResult run_result_from_json(const nlohmann::json& j) {
  RunResult r;
  r.mode = j.at("mode");
  r.dtype = j.at("dtype");
  r.blas = j.at("blas");
  r.steps = j.at("steps");
  r.timed_steps = j.at("timed_steps");
  r.items_per_s = j.at("items_per_s");
  r.median_step_ms = j.at("median_step_ms");
  r.peak_bytes = j.at("peak_bytes");
  r.train_loss = number(j.at("train_loss"));
  r.eval = {number(j.at("eval").at(0)), number(j.at("eval").at(1))};
  r.skipped = j.at("skipped");
  r.final_scale = j.at("final_scale");
  for (const auto& l : j.at("losses")) r.losses.push_back(number(l));
  for (const auto& e : j.at("evals")) {
    r.evals.emplace_back(e.at(0), EvalResult{number(e.at(1)), number(e.at(2))});
  }
  r.metrics_path = j.at("metrics_path");
  r.fp8_trace_path = j.value("fp8_trace_path", "");
  r.checkpoint_path = j.at("checkpoint_path");
  return r;
}

std::string checkpoint_path_for(const TrainConfig& config, const std::string& mode) {
  fs::path dir = config.checkpoint_dir;
  if (!config.compare.empty()) dir /= mode;
  return (dir / "checkpoint.ampx").string();
}

torch::Tensor ModeSetUp::model_output(Workload& workload, const torch::Tensor& input) const {
  // TE's fp8_autocast around the model's forward: the amaxes of its casts
  // are reduced over the group when it ends (the backward's when that ends).
  std::optional<ampx::fp8::Fp8AutocastGuard> region;
  if (fp8) region.emplace(ampx::fp8::Fp8AutocastOptions().amax_reduction_group(fp8_group));
  return workload.forward(amp->cast_input(input));
}

torch::Tensor ModeSetUp::forward(Workload& workload, const torch::Tensor& input) const {
  return amp->cast_output(model_output(workload, input));
}

ModeSetUp set_up_mode(const TrainConfig& config, Workload& workload, const Mode& mode,
                      const torch::Device& device) {
  ModeSetUp setup;
  torch::manual_seed(config.seed);
  setup.model = workload.build(device);
  auto options = ampx::optim::AdamWOptions(config.lr).weight_decay(config.weight_decay);
  if (mode.level == ampx::OptLevel::O3) {
    // Pure low precision: no masters; bf16 keeps small updates alive by
    // rounding stochastically (fp16 has the mantissa to do without).
    options.master_weights(false).stochastic_rounding(mode.dtype == torch::kBFloat16);
    options.seed(config.seed);
  }
  setup.optimizer = std::make_unique<ampx::optim::AdamW>(setup.model->parameters(), options);
  ampx::AmpOptions amp_options(mode.level);
  if (mode.mixed()) amp_options.dtype(mode.dtype).cast_model_outputs(torch::kFloat);
  if (config.tf32) amp_options.allow_tf32(true);
  setup.amp = std::make_unique<ampx::AmpSession>(
      ampx::initialize(setup.model, {setup.optimizer.get()}, amp_options));
  // Every submodule by its path, for the numerics diagnostics: ops that take
  // a parameter of "blocks.0.fc" run in that scope (after initialize(): the
  // parameters it cast are the ones the forward takes).
  ampx::debug::name_modules(*setup.model);
  if (mode.fp8) {
    // O1 plus FP8 Linears: every Linear FP8 tensor cores take (dimensions
    // multiples of 16; the gpt's vocabulary head is not), as torchao does.
    setup.fp8 = true;
    setup.fp8_layers = ampx::fp8::convert_linears(
        *setup.model, ampx::fp8::ConvertOptions().recipe(fp8_recipe_of(config)));
    TORCH_CHECK(!setup.fp8_layers.empty(), "ampx-train: --precision fp8, but ", workload.name(),
                " has no Linear layer whose dimensions are multiples of 16");
  }
  return setup;
}

StepDiagnostics::Options diagnostics_options(const TrainConfig& config) {
  StepDiagnostics::Options options;
  if (config.detect_nonfinite == "throw") options.nonfinite = ampx::debug::NonFiniteAction::kThrow;
  if (config.detect_nonfinite == "warn") options.nonfinite = ampx::debug::NonFiniteAction::kWarn;
  options.range_stats = config.range_stats;
  return options;
}

StepOutcome train_step(ModeSetUp& setup, Workload& workload, const Batch& batch,
                       ampx::dist::DistributedDataParallel* ddp, StepDiagnostics* diagnostics) {
  setup.optimizer->zero_grad();
  StepOutcome out;
  auto& scaler = setup.amp->scaler();
  {
    std::optional<StepDiagnostics::Watch> watch;
    if (diagnostics) watch.emplace(diagnostics->active() ? diagnostics : nullptr);
    torch::Tensor output;
    {
      auto forward = setup.amp->forward_guard();
      output = setup.forward(workload, batch.input);
      ampx::debug::ScopeGuard scope("loss");
      out.loss = workload.loss(output, batch.target);
      output.reset();  // as the temporary it was: freed before the backward
    }
    scaler.scale(out.loss).backward();
  }
  if (ddp) ddp->synchronize();  // averaged gradients: every rank steps (or skips) alike
  out.stepped = static_cast<bool>(scaler.step(*setup.optimizer));
  scaler.update();
  return out;
}

namespace {

/// What `fn` returns on rank 0, on every rank: rank 0 alone reads files
/// (the other hosts need not have them). When `fn` throws there, every
/// rank throws, the others with rank 0's message.
std::string from_rank0(const ampx::dist::ProcessGroup* group,
                       const std::function<std::string()>& fn) {
  if (group == nullptr) return fn();
  std::string bytes;
  int64_t failed = 0;
  if (group->rank() == 0) {
    try {
      bytes = fn();
    } catch (const c10::Error& e) {
      bytes = e.what_without_backtrace();
      failed = 1;
    }
  }
  auto header = torch::tensor({failed, static_cast<int64_t>(bytes.size())}, torch::kLong);
  group->broadcast(header);
  failed = header[0].item<int64_t>();
  auto data = torch::empty({header[1].item<int64_t>()}, torch::kByte);
  if (group->rank() == 0 && !bytes.empty())
    std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
  if (data.numel() > 0) group->broadcast(data);
  bytes.assign(static_cast<const char*>(data.data_ptr()), static_cast<size_t>(data.numel()));
  TORCH_CHECK(!failed, group->rank() == 0 ? "" : "rank 0: ", bytes);
  return bytes;
}

/// Refuses to overwrite a checkpoint, or to resume without one.
void check_checkpoint_rules(const TrainConfig& config, const std::string& ckpt) {
  if (config.resume) {
    TORCH_CHECK(fs::exists(ckpt), "ampx-train: --resume, but there is no checkpoint at '", ckpt,
                "' (--checkpoint-dir ", config.checkpoint_dir, ")");
  } else if (config.save_every > 0) {
    // Never overwrite a run the user may want back.
    TORCH_CHECK(!fs::exists(ckpt), "ampx-train: '", ckpt,
                "' already holds a checkpoint; pass --resume to continue it, or choose another "
                "--checkpoint-dir");
  }
}

/// This rank's rows of the global batch.
Batch rank_rows(Batch batch, int64_t rank, int64_t world) {
  if (world == 1) return batch;
  const int64_t rows = batch.input.size(0) / world;
  batch.input = batch.input.slice(0, rank * rows, (rank + 1) * rows);
  batch.target = batch.target.slice(0, rank * rows, (rank + 1) * rows);
  return batch;
}

/// One line of the metrics file.
nlohmann::ordered_json step_record(const TrainConfig& config, const Workload& workload,
                                   const std::string& mode, int64_t step, double loss, double scale,
                                   bool stepped, double ms, double elapsed_s) {
  return {
      {"mode", mode},
      {"step", step},
      {"epoch", static_cast<double>(step + 1) / workload.steps_per_epoch()},
      {"loss", loss},
      {"scale", scale},
      {"skipped", !stepped},
      {"lr", config.lr},
      {"step_ms", ms},
      {workload.unit() + "_per_s", workload.items_per_step() * 1000.0 / ms},
      {"elapsed_s", elapsed_s},
  };
}

/// Throughput over the steps after warm-up (the first steps pay for lazy
/// initialisation in oneDNN, the allocator and the optimizer's state).
void summarize_timing(const Workload& workload, const std::vector<double>& step_ms,
                      RunResult& result) {
  const size_t warm = std::min<size_t>(10, std::max<size_t>(1, step_ms.size() / 10));
  if (step_ms.size() <= warm) return;
  std::vector<double> timed(step_ms.begin() + static_cast<std::ptrdiff_t>(warm), step_ms.end());
  double sum = 0;
  for (double t : timed) sum += t;
  result.timed_steps = static_cast<int64_t>(timed.size());
  result.items_per_s = workload.items_per_step() * 1000.0 * timed.size() / sum;
  result.median_step_ms = median(timed);
}

/// Mode fp8: one layer's amaxes and scales (input, weight, output
/// gradient) after every step, into the metrics and a plot.
class Fp8Trace {
 public:
  Fp8Trace(const TrainConfig& config, torch::nn::Module& model,
           const std::vector<std::string>& layers) {
    layer_ = config.fp8_trace_layer.empty() ? layers.front() : config.fp8_trace_layer;
    std::string known;
    for (const auto& l : layers) known += (known.empty() ? "" : ", ") + l;
    TORCH_CHECK(std::find(layers.begin(), layers.end(), layer_) != layers.end(),
                "ampx-train: --fp8-trace-layer '", layer_, "' is not an FP8 layer of this model (",
                known, ")");
    scaling_ = ampx::fp8::scaling_of(*model.named_modules()[layer_]);
  }

  void add(int64_t step, nlohmann::ordered_json& record) {
    const ampx::fp8::TensorScaling* roles[] = {scaling_->input.get(), scaling_->weight.get(),
                                               scaling_->grad_output.get()};
    static const char* names[] = {"input", "weight", "grad_output"};
    std::array<double, 6> row{};
    for (int i = 0; i < 3; ++i) {
      row[2 * i] = roles[i]->last_amax().item<double>();
      row[2 * i + 1] = roles[i]->scale().item<double>();
      record[std::string("fp8_") + names[i] + "_amax"] = row[2 * i];
      record[std::string("fp8_") + names[i] + "_scale"] = row[2 * i + 1];
    }
    record["fp8_layer"] = layer_;
    rows_.emplace_back(step, row);
  }

  /// fp8-trace-<mode>.dat and .gp in `dir`; the PNG's path if gnuplot made
  /// it, else the data's.
  std::string write(const std::string& dir, const std::string& mode) const {
    const fs::path data = fs::path(dir) / ("fp8-trace-" + mode + ".dat");
    {
      std::ofstream f(data);
      f << "# " << layer_ << ": step input_amax input_scale weight_amax weight_scale "
        << "grad_output_amax grad_output_scale (scale: the next step's)\n";
      for (const auto& [step, r] : rows_) {
        f << step + 1;
        for (double v : r) f << " " << v;
        f << "\n";
      }
    }
    const std::string png = "fp8-trace-" + mode + ".png";
    const std::string script = "fp8-trace-" + mode + ".gp";
    {
      std::ofstream f(fs::path(dir) / script);
      const std::string d = data.filename().string();
      f << "set terminal pngcairo size 1400,520 font ',11'\nset output '" << png << "'\n"
        << "set multiplot layout 1,2 title 'FP8 scaling of " << layer_ << "'\n"
        << "set grid\nset logscale y\nset key bottom right\nset xlabel 'step'\n"
        << "set offsets 0, 0, graph 0.08, graph 0.08\n"
        << "set title 'amax (after the step)'\n"
        << "plot '" << d << "' using 1:2 with lines title 'input', '' using 1:4 with lines "
        << "title 'weight', '' using 1:6 with lines title 'output gradient'\n"
        << "set title 'scale'\n"
        << "plot '" << d << "' using 1:3 with lines title 'input (E4M3)', '' using 1:5 with "
        << "lines title 'weight (E4M3)', '' using 1:7 with lines title 'output gradient'\n"
        << "unset multiplot\n";
    }
    std::string note;
    const std::string plot = run_gnuplot(dir, script, png, note);
    return plot.empty() ? data.string() : plot;
  }

 private:
  std::string layer_;
  std::shared_ptr<ampx::fp8::LinearScaling> scaling_;
  std::vector<std::pair<int64_t, std::array<double, 6>>> rows_;
};

}  // namespace

RunResult train_mode(const TrainConfig& config, Workload& workload, const std::string& mode_name,
                     const ampx::dist::ProcessGroup* group) {
  const Mode mode = parse_mode(mode_name, config);
  const int64_t rank = group ? group->rank() : 0, world = group ? group->world_size() : 1;
  const bool lead = rank == 0;  // writes files, shows progress, evaluates
  TORCH_CHECK(config.batch_size % world == 0, "ampx-train: --batch-size ", config.batch_size,
              " (the global batch) must be divisible by the ", world, " processes");
  const torch::Device device(config.device == "cuda" ? torch::kCUDA : torch::kCPU);
  RunResult result;
  result.mode = mode.name;
  result.dtype = mode.dtype_name();
  result.blas = blas_library();
  const int64_t total_steps =
      config.steps > 0
          ? config.steps
          : std::max<int64_t>(
                1, static_cast<int64_t>(std::ceil(config.epochs * workload.steps_per_epoch())));
  result.steps = total_steps;

  nlohmann::json identity = workload.identity();
  identity["precision"] = mode.name;
  identity["dtype"] = result.dtype;
  identity["device"] = config.device;
  identity["steps_per_epoch"] = workload.steps_per_epoch();
  if (mode.fp8) identity["fp8_recipe"] = fp8_recipe_of(config).to_string();

  const std::string ckpt = checkpoint_path_for(config, mode.name);
  from_rank0(group, [&] {  // rank 0 alone writes and reads checkpoints
    check_checkpoint_rules(config, ckpt);
    return std::string();
  });
  // A preemption checkpoint never replaces one this run neither resumed nor writes anyway.
  const bool may_write_checkpoint = config.resume || config.save_every > 0 || !fs::exists(ckpt);

  const int64_t base = allocated_bytes(device);
  reset_peak_memory(device);

  ModeSetUp setup = set_up_mode(config, workload, mode, device);
  auto& model = *setup.model;
  auto& optimizer = *setup.optimizer;
  auto& amp = *setup.amp;
  // Before DDP's broadcast of the parameters: a rank started with another
  // model shape or precision fails here, on every rank, naming the difference.
  if (group) check_ranks_agree(*group, run_fingerprint(identity, model, total_steps));
  // After the cast: the broadcast and the buckets see the training dtypes.
  std::optional<ampx::dist::DistributedDataParallel> ddp;
  if (group) ddp.emplace(setup.model, *group);
  // TE's reduce_amax: the same scales on every rank, so the ranks stay bitwise.
  if (group && setup.fp8 && fp8_recipe_of(config).is_delayed()) setup.fp8_group = group;
  std::optional<Fp8Trace> fp8_trace;
  if (setup.fp8 && lead) fp8_trace.emplace(config, model, setup.fp8_layers);

  LoopState state;
  if (config.resume) {
    const std::string bytes = from_rank0(group, [&] { return read_file_bytes(ckpt); });
    load(ckpt, parse_checkpoint(bytes, ckpt), identity, model, optimizer, amp, state);
    TORCH_CHECK(state.next_step <= total_steps, "ampx-train: checkpoint '", ckpt, "' is at step ",
                state.next_step, ", past this run's ", total_steps, " steps; raise --steps");
  }

  if (lead) fs::create_directories(config.out_dir);
  const bool csv = config.metrics_format == "csv";
  std::optional<MetricsWriter> metrics;
  if (lead) {
    metrics.emplace(fs::path(config.out_dir) / ("metrics-" + mode.name + (csv ? ".csv" : ".jsonl")),
                    csv, config.resume ? state.next_step - 1 : -1);
    result.metrics_path = metrics->path().string();
  }
  Progress progress(mode.name, state.next_step, total_steps, workload.unit() + "/s",
                    lead ? Progress::style_for(config.progress) : Progress::Style::kNone,
                    config.log_every);

  auto evaluate = [&]() {
    torch::NoGradGuard no_grad;
    model.eval();
    EvalResult r = workload.evaluate(
        [&](const torch::Tensor& input) {
          auto forward = amp.forward_guard();
          return setup.forward(workload, input);
        },
        device);
    model.train();
    return r;
  };

  // --profile: one step after warm-up, left out of the timing (the profiler slows it).
  const int64_t profile_step =
      config.profile.empty() || !lead
          ? -1
          : state.next_step + std::min<int64_t>(10, (total_steps - state.next_step) / 2);
  const std::string profile_path =
      profile_path_for(config.profile, mode.name, !config.compare.empty());
  StepDiagnostics diagnostics(diagnostics_options(config));
  std::vector<double> step_ms;
  const auto run_start = std::chrono::steady_clock::now();
  for (int64_t step = state.next_step; step < total_steps; ++step) {
    std::optional<StepProfile> profile;
    if (step == profile_step) profile.emplace(profile_path);
    const auto t0 = std::chrono::steady_clock::now();
    const Batch batch = rank_rows(workload.batch(step, device), rank, world);
    ampx::debug::set_step(step);
    StepOutcome outcome;
    try {
      outcome = train_step(setup, workload, batch, ddp ? &*ddp : nullptr, &diagnostics);
    } catch (const ampx::debug::NonFiniteError&) {
      progress.finish();  // the live line ends before main prints the report
      throw;
    }
    auto& [loss, stepped] = outcome;
    // A preemption signal (preemption.h) stops the run after this step; the
    // ranks agree on it through the loss's all-reduce: one flag per rank.
    bool stop = preemption_signal() != 0;
    if (group) {  // the global batch's loss: the mean of the ranks' means
      const auto local = loss.detach().to(torch::kFloat).reshape({1});
      auto global = torch::cat({local, torch::full({1}, stop ? 1.0 : 0.0, local.options())});
      group->all_reduce_sum(global);
      loss = global.slice(0, 0, 1) / static_cast<double>(world);
      stop = global[1].item<float>() > 0;
    }
    const double loss_value = loss.item<double>();  // also waits for the device
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (profile) {
      profile.reset();  // writes the trace
      result.profile_summary = "[" + mode.name + "] profile of step " + std::to_string(step + 1) +
                               " (" + std::to_string(ms) +
                               " ms with the profiler on): " + profile_path + "\n" +
                               summarize_trace(profile_path, 15);
    } else {
      step_ms.push_back(ms);
    }
    if (!stepped) ++state.skipped;
    state.losses.push_back(loss_value);
    const double scale = amp.scaler().is_enabled() ? amp.scaler().get_scale() : 1.0;
    nlohmann::ordered_json record = step_record(
        config, workload, mode.name, step, loss_value, scale, stepped, ms,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count());
    const bool eval_now = lead && config.eval_every > 0 && (step + 1) % config.eval_every == 0 &&
                          step + 1 < total_steps;
    if (eval_now) {
      const EvalResult e = evaluate();
      result.evals.emplace_back(step + 1, e);
      record["eval_loss"] = e.loss;
      record["eval_" + workload.metric_name()] = e.metric;
    }
    if (fp8_trace) fp8_trace->add(step, record);
    if (metrics) metrics->write(record);
    progress.update(step, loss_value, scale, workload.items_per_step() * 1000.0 / ms);
    state.next_step = step + 1;
    const bool planned =
        config.save_every > 0 && ((step + 1) % config.save_every == 0 || step + 1 == total_steps);
    stop = stop && step + 1 < total_steps;  // after the last step: the run ends as planned
    if (planned || stop) {
      TORCH_CHECK(planned || may_write_checkpoint, "ampx-train: ", signal_name(preemption_signal()),
                  " asked to stop after step ", step + 1, ", but '", ckpt,
                  "' holds a checkpoint this run did not write; it stays as it is, and the steps "
                  "of this run are lost (pass --save-every or another --checkpoint-dir)");
      if (lead) save(ckpt, identity, workload, model, optimizer, amp, state);
      result.checkpoint_path = ckpt;
    }
    if (stop) {
      result.preempted_after = step + 1;
      break;
    }
  }
  progress.finish();
  if (result.preempted_after > 0) {
    result.losses = std::move(state.losses);
    return result;  // no evaluation or timing: the process is asked to end
  }
  result.peak_bytes = peak_allocated_bytes(device) - base;
  ampx::debug::set_step(-1);
  result.nonfinite_summary = diagnostics.nonfinite_summary();
  if (config.range_stats && lead) {
    const auto path = fs::path(config.out_dir) / ("range-stats-" + mode.name + ".json");
    write_output_file(path, diagnostics.range_stats().to_json() + "\n");
    result.range_stats_path = path.string();
  }

  if (fp8_trace) result.fp8_trace_path = fp8_trace->write(config.out_dir, mode.name);
  summarize_timing(workload, step_ms, result);
  result.skipped = state.skipped;
  result.losses = std::move(state.losses);
  const auto& losses = result.losses;  // steps >= 1, so never empty
  const auto tail = std::max<std::ptrdiff_t>(1, static_cast<std::ptrdiff_t>(losses.size()) / 10);
  result.train_loss = std::accumulate(losses.end() - tail, losses.end(), 0.0) / tail;
  result.final_scale = amp.scaler().is_enabled() ? amp.scaler().get_scale() : 1.0;
  if (lead) result.eval = evaluate();
  result.weights_checksum = weights_checksum(model);
  return result;
}

}  // namespace ampx::train

#ifdef AMPX_TRAINER_GCC14_PUSHED
#pragma GCC diagnostic pop
#undef AMPX_TRAINER_GCC14_PUSHED
#endif
