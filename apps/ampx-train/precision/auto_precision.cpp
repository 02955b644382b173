#include "auto_precision.h"

#include "fp8_layers.h"
#include "run/checkpoint.h"
#include "run/trainer.h"

#include "files/atomic_file.h"  // ampx's src/: read_file, write_file_atomically

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace ampx::train {
namespace {

std::string percent(double v) {
  std::ostringstream s;
  s << std::showpos << std::fixed << std::setprecision(3) << 100.0 * v << "%";
  return s.str();
}

// The measurement problem of `workload`: its models, each kept with its
// forward (an AnyModule) so that the loss can run the model it is handed.
struct WorkloadProblem {
  Workload& workload;
  torch::Device device;
  std::vector<torch::nn::AnyModule> models;

  ampx::plan::MeasureProblem problem() {
    ampx::plan::MeasureProblem p;
    p.make_model = [this] {
      models.push_back(workload.build(device));
      return models.back().ptr();
    };
    p.loss = [this](torch::nn::Module& model, int64_t step) {
      for (auto& m : models) {
        if (m.ptr().get() != &model) continue;
        const Batch batch = workload.batch(step, device);
        return workload.loss(m.forward(batch.input), batch.target);
      }
      TORCH_CHECK(false, "ampx-train: a model the measurement did not make");
    };
    return p;
  }
};

// An assignment's predicted loss change and modelled cost, as make_plan
// counts them: `format_of(layer)` per layer, the reference's format where it
// was not measured or the target lacks it.
std::pair<double, double> predict(
    const ampx::plan::Measurement& m, const ampx::plan::CostModel& model,
    const std::function<ampx::plan::LayerFormat(const ampx::plan::LayerMeasurement&)>& format_of) {
  double loss = 0, cost = 0;
  for (const auto& layer : m.layers) {
    const ampx::plan::FormatMeasurement* chosen = &layer.formats.front();  // the reference
    for (const auto& f : layer.formats) {
      if (f.format == format_of(layer) && model.throughput.count(f.format)) chosen = &f;
    }
    loss += std::max(0.0, chosen->loss_change);
    cost += layer.flops_share / model.throughput.at(chosen->format);
  }
  return {loss, cost};
}

}  // namespace

std::string alternatives_table(const ampx::plan::Measurement& measurement,
                               const ampx::plan::CostModel& model,
                               const std::vector<std::string>& fixed_rule_bf16) {
  using ampx::plan::LayerFormat;
  std::ostringstream t;
  t << "beside uniform and fixed choices (predicted loss change, modelled product time on "
    << model.target << " against bf16; a layer a format cannot take counted in "
    << ampx::plan::to_string(measurement.reference) << "):\n";
  const auto row = [&](const std::string& name, const auto& format_of) {
    const auto [loss, cost] = predict(measurement, model, format_of);
    t << "  " << std::left << std::setw(44) << name << std::right << std::setw(10) << percent(loss)
      << std::setw(8) << std::fixed << std::setprecision(3) << cost << "\n";
  };
  for (const auto f : ampx::plan::all_layer_formats()) {
    const bool measured = std::any_of(
        measurement.layers.begin(), measurement.layers.end(), [f](const auto& layer) {
          return std::any_of(layer.formats.begin(), layer.formats.end(),
                             [f](const auto& m) { return m.format == f; });
        });
    if (!model.throughput.count(f) || !measured) continue;
    row("all " + ampx::plan::to_string(f), [f](const auto&) { return f; });
  }
  if (model.throughput.count(LayerFormat::kNvfp4)) {
    row("first/last blocks and head bf16, rest nvfp4", [&](const auto& layer) {
      const bool kept = std::find(fixed_rule_bf16.begin(), fixed_rule_bf16.end(), layer.module) !=
                        fixed_rule_bf16.end();
      return kept ? LayerFormat::kBFloat16 : LayerFormat::kNvfp4;
    });
  }
  return t.str();
}

namespace {

// "0.5%" or "0.005" -> 0.005; NaN when `text` is neither.
double parse_share(const std::string& text) {
  std::string number = text;
  const bool is_percent = !number.empty() && number.back() == '%';
  if (is_percent) number.pop_back();
  char* end = nullptr;
  const double v = number.empty() ? NAN : std::strtod(number.c_str(), &end);
  if (number.empty() || end != number.c_str() + number.size() || !std::isfinite(v)) return NAN;
  return is_percent ? v / 100.0 : v;
}

}  // namespace

double parse_loss_budget(const std::string& text) {
  const double v = parse_share(text);
  TORCH_CHECK(v > 0, "ampx-train: --loss-budget '", text,
              "' is not a loss change > 0 (e.g. 0.5% or 0.005)");
  return v;
}

double parse_tail(const std::string& text, const std::string& flag) {
  const double v = parse_share(text);
  TORCH_CHECK(v >= 0 && v < 1, "ampx-train: ", flag, " '", text,
              "' is not a share of the steps in [0, 1) (e.g. 10%, 0.1 or 0)");
  return v;
}

std::vector<ampx::plan::Floor> plan_end_floors(const TrainConfig& config,
                                               torch::nn::Module& model) {
  if (config.plan_ends == "none") return {};
  const auto format = ampx::plan::parse_layer_format(config.plan_ends, "--plan-ends");
  std::vector<ampx::plan::Floor> floors;
  for (const auto& end : end_blocks(model)) floors.push_back({end, format});
  return floors;
}

std::string floors_text(const std::vector<ampx::plan::Floor>& floors) {
  std::string text;
  std::vector<ampx::plan::LayerFormat> done;
  for (const auto& floor : floors) {
    if (std::find(done.begin(), done.end(), floor.format) != done.end()) continue;
    done.push_back(floor.format);
    std::string prefixes;
    for (const auto& f : floors) {
      if (f.format == floor.format) prefixes += (prefixes.empty() ? "" : ", ") + f.prefix;
    }
    text += (text.empty() ? "" : "; ") + prefixes + " at " +
            std::to_string(ampx::plan::element_bits(floor.format)) + "-bit elements or wider (" +
            ampx::plan::to_string(floor.format) + ")";
  }
  return text.empty() ? "none" : text;
}

std::string measured_plan_path(const TrainConfig& config) {
  return (std::filesystem::path(config.out_dir) / "precision-plan.json").string();
}

std::string plan_table(const ampx::plan::Measurement& measurement,
                       const ampx::plan::PrecisionPlan& plan, const ampx::plan::CostModel& model) {
  std::ostringstream t;
  t << std::left << std::setw(22) << "layer" << std::setw(8) << "flops";
  // The columns: the formats of the layer measured in the most (some take bf16 only).
  const auto& formats = std::max_element(measurement.layers.begin(), measurement.layers.end(),
                                         [](const auto& a, const auto& b) {
                                           return a.formats.size() < b.formats.size();
                                         })
                            ->formats;
  for (const auto& f : formats) t << std::setw(18) << ampx::plan::to_string(f.format);
  t << "plan\n";
  for (size_t l = 0; l < measurement.layers.size(); ++l) {
    const auto& layer = measurement.layers[l];
    std::ostringstream share;
    share << std::fixed << std::setprecision(1) << 100.0 * layer.flops_share << "%";
    t << std::setw(22) << layer.module << std::setw(8) << share.str();
    for (const auto& want : formats) {
      std::string cell = "-";
      for (const auto& f : layer.formats) {
        if (f.format != want.format) continue;
        std::ostringstream c;
        c << percent(f.loss_change) << " g" << std::fixed << std::setprecision(3) << f.grad_error;
        cell = c.str();
      }
      t << std::setw(18) << cell;
    }
    t << ampx::plan::to_string(plan.layers[l].format) << "\n";
  }
  t << "loss change: predicted " << percent(plan.predicted_loss_change) << " (budget "
    << percent(plan.loss_budget) << "); modelled product time on " << plan.target << ": "
    << std::fixed << std::setprecision(3) << plan.cost / plan.bf16_cost << " of bf16's";
  if (plan.tail > 0) {
    t << "; " << ampx::plan::run_cost(plan, model) / plan.bf16_cost << " over the run, its last "
      << std::setprecision(1) << 100.0 * plan.tail << "% of steps in "
      << ampx::plan::to_string(plan.reference) << std::setprecision(3);
  }
  t << "\n";
  if (!plan.floors.empty()) t << "floors: " << floors_text(plan.floors) << "\n";
  t << "measured in " << std::setprecision(1) << measurement.seconds << " s, " << measurement.probes
    << " probes of " << measurement.steps << " steps + " << measurement.eval_batches
    << " evaluation batches";
  if (measurement.epoch_fraction > 0) {
    t << " (" << std::setprecision(3) << measurement.epoch_fraction << " of an epoch)";
  }
  t << "\n";
  return t.str();
}

namespace {

// The proof run's result, and how many plans it took.
std::string proof_line(const ampx::plan::ProvenPlan& proven) {
  std::ostringstream s;
  s << "proof run: loss change " << percent(proven.check.loss_change) << " (budget "
    << percent(proven.plan.loss_budget) << ")";
  if (proven.rounds > 1) {
    s << ", plan " << proven.rounds << ": the proof runs of the ones before left the budget, "
      << (proven.planned_budget > 0 ? "this one was solved for " + percent(proven.planned_budget)
                                    : "so every Linear stays in " +
                                          ampx::plan::to_string(proven.plan.reference));
  }
  s << "\n";
  return s.str();
}

}  // namespace

std::string plan_precision(const TrainConfig& config, Workload& workload) {
  check_checkpoint_rules(config, checkpoint_path_for(config, "auto"));
  const torch::Device device = config.torch_device();
  WorkloadProblem problem{workload, device, {}};
  torch::manual_seed(config.seed);
  torch::nn::AnyModule model = workload.build(device);
  const auto cost_model = ampx::plan::cost_model_for(config.target);
  const auto reference = ampx::plan::parse_layer_format(config.plan_reference, "--plan-reference");
  // Only formats faster than the reference on the target can win a layer
  // (the reference changes nothing): the others are not probed.
  std::vector<ampx::plan::LayerFormat> formats;
  for (const auto f : ampx::plan::all_layer_formats()) {
    const auto it = cost_model.throughput.find(f);
    if (it != cost_model.throughput.end() && it->second > cost_model.throughput.at(reference)) {
      formats.push_back(f);
    }
  }
  const auto options = ampx::plan::MeasureOptions()
                           .formats(formats)
                           .reference(reference)
                           .steps(config.plan_steps)
                           .eval_batches(2)
                           .lr(config.lr)
                           .seed(config.seed)
                           .tokens_per_step(workload.items_per_step())
                           .steps_per_epoch(workload.steps_per_epoch());
  std::cout << "measuring each Linear in each format (" << config.plan_steps
            << " steps a probe) ..." << std::endl;
  const auto measurement = ampx::plan::measure_layers(*model.ptr(), problem.problem(), options);
  // Proven on training: planned again for less while the proof run (one
  // more probe with the whole plan) leaves the budget.
  const auto proven = ampx::plan::prove_plan(
      *model.ptr(), problem.problem(), measurement,
      ampx::plan::PlanOptions(parse_loss_budget(config.loss_budget))
          .cost_model(cost_model)
          .seed(config.seed)
          .tail(parse_tail(config.plan_tail, "--plan-tail"))
          .floors(plan_end_floors(config, *model.ptr())),
      options);
  const auto& plan = proven.plan;
  // The fixed rule beside it: --precision nvfp4's --bf16-layers auto.
  TrainConfig fixed = config;
  fixed.bf16_layers = "auto";
  const auto kept = bf16_layers_of(fixed, "nvfp4", *model.ptr());
  std::cout << "\n"
            << plan_table(measurement, plan, cost_model)
            << alternatives_table(measurement, cost_model, kept);
  std::filesystem::create_directories(config.out_dir);
  const std::string path = measured_plan_path(config);
  ampx::plan::save_plan(plan, path);
  std::cout << proof_line(proven) << "plan:    " << path << "\n" << std::endl;
  return path;
}

std::string read_plan_text(const std::string& path) {
  auto text = ampx::detail::read_file(path);
  TORCH_CHECK(text, "ampx-train: cannot read the plan '", path, "'");
  return std::move(*text);
}

std::string resumed_plan(const TrainConfig& config) {
  const std::filesystem::path checkpoint = checkpoint_path_for(config, "auto");
  check_checkpoint_rules(config, checkpoint.string());
  const Checkpoint saved = read_checkpoint(checkpoint);
  const auto precision = saved.meta.at("run").value("precision", std::string());
  TORCH_CHECK(precision == "auto", "ampx-train: --resume --precision auto: checkpoint '",
              checkpoint.string(), "' was written by a run with precision=\"", precision,
              "\"; resume it with that --precision, or pass another --checkpoint-dir");
  const std::string text = read_progress(checkpoint, saved).state.plan_file;
  TORCH_CHECK(!text.empty(), "ampx-train: --resume --precision auto: checkpoint '",
              checkpoint.string(),
              "' holds no plan (an older ampx-train wrote it); pass the plan it trained with "
              "as --precision-plan");
  const std::string path = (checkpoint.parent_path() / "precision-plan.json").string();
  ampx::detail::write_file_atomically(path, text.data(), text.size(), "ampx-train: plan");
  std::cout << "auto plan: " << path << " (the plan checkpoint '" << checkpoint.string()
            << "' trained with)\n"
            << std::endl;
  return path;
}

}  // namespace ampx::train
