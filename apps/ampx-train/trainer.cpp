#include "trainer.h"

#include "checkpoint.h"
#include "device_memory.h"
#include "profile.h"
#include "progress.h"

#include <ampx/ampx.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <numeric>
#include <optional>
#include <sstream>

namespace ampx::train {
namespace {

namespace fs = std::filesystem;

c10::ScalarType scalar_type_of(const std::string& dtype) {
  return dtype == "fp16" ? torch::kHalf : torch::kBFloat16;
}

nlohmann::json to_json(const ampx::StateDict& dict) {
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

ampx::StateDict state_dict_from_json(const nlohmann::json& j) {
  ampx::StateDict out;
  for (const auto& [key, value] : j.items()) {
    if (value.is_number_float()) {
      out[key] = value.get<double>();
    } else if (value.is_number_integer()) {
      out[key] = value.get<int64_t>();
    } else if (value.is_boolean()) {
      out[key] = value.get<bool>();
    } else if (value.is_null()) {
      out[key] = c10::IValue();
    } else {
      out[key] = value.get<std::string>();
    }
  }
  return out;
}

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
  for (const auto& [name, dict] : amp.state_dict()) amp_state[name] = to_json(dict);
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

void load(const std::string& path, const nlohmann::json& identity, torch::nn::Module& model,
          torch::optim::Optimizer& opt, ampx::AmpSession& amp, LoopState& state) {
  const Checkpoint c = read_checkpoint(path);
  check_compatible(path, c.meta.at("run"), identity);
  try {
    std::istringstream payload(c.payload);
    torch::serialize::InputArchive archive, model_archive, opt_archive;
    archive.load_from(payload);
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
  std::map<std::string, ampx::StateDict> amp_state;
  for (const auto& [name, dict] : c.meta.at("amp").items()) {
    amp_state[name] = state_dict_from_json(dict);
  }
  amp.load_state_dict(amp_state);
  state.next_step = c.meta.at("step").get<int64_t>();
  state.skipped = c.meta.at("skipped").get<int64_t>();
  state.losses = c.meta.at("losses").get<std::vector<double>>();
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
  r.checkpoint_path = j.at("checkpoint_path");
  return r;
}

std::string checkpoint_path_for(const TrainConfig& config, const std::string& mode) {
  fs::path dir = config.checkpoint_dir;
  if (!config.compare.empty()) dir /= mode;
  return (dir / "checkpoint.ampx").string();
}

RunResult train_mode(const TrainConfig& config, Workload& workload, const std::string& mode,
                     const ampx::dist::ProcessGroup* group) {
  const int64_t rank = group ? group->rank() : 0, world = group ? group->world_size() : 1;
  const bool lead = rank == 0;  // writes files, shows progress, evaluates
  TORCH_CHECK(config.batch_size % world == 0, "ampx-train: --batch-size ", config.batch_size,
              " (the global batch) must be divisible by the ", world, " processes");
  const torch::Device device(config.device == "cuda" ? torch::kCUDA : torch::kCPU);
  const bool mixed = mode != "fp32";
  RunResult result;
  result.mode = mode;
  result.dtype = mixed ? config.dtype : "fp32";
  const int64_t total_steps =
      config.steps > 0
          ? config.steps
          : std::max<int64_t>(
                1, static_cast<int64_t>(std::ceil(config.epochs * workload.steps_per_epoch())));
  result.steps = total_steps;

  nlohmann::json identity = workload.identity();
  identity["precision"] = mode;
  identity["dtype"] = result.dtype;
  identity["device"] = config.device;
  identity["steps_per_epoch"] = workload.steps_per_epoch();

  const std::string ckpt = checkpoint_path_for(config, mode);
  if (config.resume) {
    TORCH_CHECK(fs::exists(ckpt), "ampx-train: --resume, but there is no checkpoint at '", ckpt,
                "' (--checkpoint-dir ", config.checkpoint_dir, ")");
  } else if (config.save_every > 0) {
    // Never overwrite a run the user may want back.
    TORCH_CHECK(!fs::exists(ckpt), "ampx-train: '", ckpt,
                "' already holds a checkpoint; pass --resume to continue it, or choose another "
                "--checkpoint-dir");
  }

  const int64_t base = allocated_bytes(device);
  reset_peak_memory(device);

  torch::manual_seed(config.seed);
  auto model = workload.build(device);
  auto options = ampx::optim::AdamWOptions(config.lr).weight_decay(config.weight_decay);
  if (mode == "O3") {
    // Pure low precision: no masters; bf16 keeps small updates alive by
    // rounding stochastically (fp16 has the mantissa to do without).
    options.master_weights(false).stochastic_rounding(result.dtype == "bf16" && device.is_cpu());
    options.seed(config.seed);
  }
  ampx::optim::AdamW optimizer(model->parameters(), options);
  ampx::AmpOptions amp_options(mixed ? ampx::parse_opt_level(mode) : ampx::OptLevel::O0);
  if (mixed) amp_options.dtype(scalar_type_of(config.dtype)).cast_model_outputs(torch::kFloat);
  ampx::AmpSession amp = ampx::initialize(model, {&optimizer}, amp_options);
  // After the cast: the broadcast and the buckets see the training dtypes.
  std::optional<ampx::dist::DistributedDataParallel> ddp;
  if (group) ddp.emplace(model, *group);

  LoopState state;
  if (config.resume) {
    load(ckpt, identity, *model, optimizer, amp, state);
    TORCH_CHECK(state.next_step <= total_steps, "ampx-train: checkpoint '", ckpt, "' is at step ",
                state.next_step, ", past this run's ", total_steps, " steps; raise --steps");
  }

  fs::create_directories(config.out_dir);
  const bool csv = config.metrics_format == "csv";
  std::optional<MetricsWriter> metrics;
  if (lead) {
    metrics.emplace(fs::path(config.out_dir) / ("metrics-" + mode + (csv ? ".csv" : ".jsonl")), csv,
                    config.resume ? state.next_step - 1 : -1);
    result.metrics_path = metrics->path().string();
  }
  Progress progress(mode, state.next_step, total_steps, workload.unit() + "/s",
                    lead ? Progress::style_for(config.progress) : Progress::Style::kNone,
                    config.log_every);

  auto eval_forward = [&](const torch::Tensor& input) {
    auto forward = amp.forward_guard();
    return amp.cast_output(workload.forward(amp.cast_input(input)));
  };
  auto evaluate = [&]() {
    torch::NoGradGuard no_grad;
    model->eval();
    EvalResult r = workload.evaluate(eval_forward, device);
    model->train();
    return r;
  };

  // --profile: one step after warm-up, left out of the timing (the profiler slows it).
  const int64_t profile_step =
      config.profile.empty() || !lead
          ? -1
          : state.next_step + std::min<int64_t>(10, (total_steps - state.next_step) / 2);
  const std::string profile_path = profile_path_for(config.profile, mode, !config.compare.empty());
  std::vector<double> step_ms;
  const auto run_start = std::chrono::steady_clock::now();
  for (int64_t step = state.next_step; step < total_steps; ++step) {
    std::optional<StepProfile> profile;
    if (step == profile_step) profile.emplace(profile_path);
    const auto t0 = std::chrono::steady_clock::now();
    Batch batch = workload.batch(step, device);
    if (world > 1) {  // this rank's rows of the global batch
      const int64_t rows = batch.input.size(0) / world;
      batch.input = batch.input.slice(0, rank * rows, (rank + 1) * rows);
      batch.target = batch.target.slice(0, rank * rows, (rank + 1) * rows);
    }
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      auto forward = amp.forward_guard();
      auto output = amp.cast_output(workload.forward(amp.cast_input(batch.input)));
      loss = workload.loss(output, batch.target);
    }
    auto& scaler = amp.scaler();
    scaler.scale(loss).backward();
    if (ddp) ddp->synchronize();  // averaged gradients: every rank steps (or skips) alike
    const bool stepped = static_cast<bool>(scaler.step(optimizer));
    scaler.update();
    if (group) {  // the global batch's loss: the mean of the ranks' means
      auto global = loss.detach().to(torch::kFloat).reshape({1});
      group->all_reduce_sum(global);
      loss = global / static_cast<double>(world);
    }
    const double loss_value = loss.item<double>();  // also waits for the device
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (profile) {
      profile.reset();  // writes the trace
      result.profile_summary = "[" + mode + "] profile of step " + std::to_string(step + 1) + " (" +
                               std::to_string(ms) + " ms with the profiler on): " + profile_path +
                               "\n" + summarize_trace(profile_path, 15);
    } else {
      step_ms.push_back(ms);
    }
    if (!stepped) ++state.skipped;
    state.losses.push_back(loss_value);
    const double scale = scaler.is_enabled() ? scaler.get_scale() : 1.0;
    const double rate = workload.items_per_step() * 1000.0 / ms;
    nlohmann::ordered_json record = {
        {"mode", mode},
        {"step", step},
        {"epoch", static_cast<double>(step + 1) / workload.steps_per_epoch()},
        {"loss", loss_value},
        {"scale", scale},
        {"skipped", !stepped},
        {"lr", config.lr},
        {"step_ms", ms},
        {workload.unit() + "_per_s", rate},
        {"elapsed_s",
         std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count()},
    };
    const bool eval_now = lead && config.eval_every > 0 && (step + 1) % config.eval_every == 0 &&
                          step + 1 < total_steps;
    if (eval_now) {
      const EvalResult e = evaluate();
      result.evals.emplace_back(step + 1, e);
      record["eval_loss"] = e.loss;
      record["eval_" + std::string(workload.name() == "gpt" ? "bpc" : "accuracy")] = e.metric;
    }
    if (metrics) metrics->write(record);
    progress.update(step, loss_value, scale, rate);
    state.next_step = step + 1;
    if (config.save_every > 0 && ((step + 1) % config.save_every == 0 || step + 1 == total_steps)) {
      if (lead) save(ckpt, identity, workload, *model, optimizer, amp, state);
      result.checkpoint_path = ckpt;
    }
  }
  progress.finish();
  result.peak_bytes = peak_allocated_bytes(device) - base;

  // Throughput over the steps after warm-up (the first steps pay for lazy
  // initialisation in oneDNN, the allocator and the optimizer's state).
  const size_t warm = std::min<size_t>(10, std::max<size_t>(1, step_ms.size() / 10));
  if (step_ms.size() > warm) {
    std::vector<double> timed(step_ms.begin() + static_cast<std::ptrdiff_t>(warm), step_ms.end());
    double sum = 0;
    for (double t : timed) sum += t;
    result.timed_steps = static_cast<int64_t>(timed.size());
    result.items_per_s = workload.items_per_step() * 1000.0 * timed.size() / sum;
    result.median_step_ms = median(timed);
  }
  result.skipped = state.skipped;
  result.losses = std::move(state.losses);
  const auto& losses = result.losses;  // steps >= 1, so never empty
  const auto tail = std::max<std::ptrdiff_t>(1, static_cast<std::ptrdiff_t>(losses.size()) / 10);
  result.train_loss = std::accumulate(losses.end() - tail, losses.end(), 0.0) / tail;
  result.final_scale = amp.scaler().is_enabled() ? amp.scaler().get_scale() : 1.0;
  if (lead) result.eval = evaluate();
  return result;
}

}  // namespace ampx::train
