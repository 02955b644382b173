// The measurement pass: one probe per (Linear, format) and a reference, each
// a few AdamW steps from the model's weights and an evaluation after them.

#include "ampx/precision_plan.h"

#include "ampx/autocast.h"
#include "ampx/fp8/linear.h"
#include "linears.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>

namespace ampx {
namespace plan {
namespace {

// What a probe leaves: its evaluation loss and the first weight gradient of
// each layer asked for (float32 copies).
struct ProbeResult {
  double eval_loss = 0;
  std::map<std::string, at::Tensor> first_grads;
};

void check_problem(const MeasureProblem& problem, const MeasureOptions& options) {
  TORCH_CHECK_VALUE(problem.make_model && problem.loss,
                    "ampx::plan: MeasureProblem needs make_model and loss");
  TORCH_CHECK_VALUE(options.steps() >= 1, "ampx::plan: MeasureOptions::steps must be >= 1, got ",
                    options.steps());
  TORCH_CHECK_VALUE(options.eval_batches() >= 1,
                    "ampx::plan: MeasureOptions::eval_batches must be >= 1, got ",
                    options.eval_batches());
  TORCH_CHECK_VALUE(options.lr() > 0 && std::isfinite(options.lr()),
                    "ampx::plan: MeasureOptions::lr must be > 0, got ", options.lr());
  TORCH_CHECK_VALUE(options.reference() == LayerFormat::kBFloat16 ||
                        options.reference() == LayerFormat::kFloat32,
                    "ampx::plan: MeasureOptions::reference must be bf16 or fp32, got ",
                    to_string(options.reference()));
  TORCH_CHECK_VALUE(options.tokens_per_step() >= 1,
                    "ampx::plan: MeasureOptions::tokens_per_step must be >= 1, got ",
                    options.tokens_per_step());
}

// `problem`'s loss of batch `step` under bf16 autocast and an FP8 region (FP8
// only where a layer was converted), as ampx-train's FP8 modes run.
at::Tensor region_loss(torch::nn::Module& model, const MeasureProblem& problem, int64_t step,
                       c10::DeviceType device) {
  AutocastGuard autocast(device, at::kBFloat16);
  fp8::Fp8AutocastGuard region;
  at::Tensor loss = problem.loss(model, step);
  TORCH_CHECK_VALUE(loss.defined() && loss.numel() == 1,
                    "ampx::plan: MeasureProblem::loss must return a scalar, got ",
                    loss.defined() ? loss.sizes() : at::IntArrayRef{});
  return loss;
}

// Readies a probe's model: every Linear but `path` in the reference format,
// the one at `path` (none: "" matches no Linear but a bare one) in `format`.
std::function<void(torch::nn::Module&)> probe_formats(LayerFormat reference,
                                                      const std::string& path,
                                                      LayerFormat format, uint64_t seed) {
  return [=](torch::nn::Module& model) {
    std::vector<std::string> others;
    bool found = false;
    for (const auto& [name, linear] : detail::linears_of(model)) {
      if (name == path) {
        found = true;
      } else {
        others.push_back(name);
      }
    }
    detail::convert_layers(model, others, reference, seed);
    if (found) detail::convert_layers(model, {path}, format, seed);
  };
}

// The reference probe's: every Linear in the reference format.
std::function<void(torch::nn::Module&)> reference_formats(LayerFormat reference) {
  return [=](torch::nn::Module& model) {
    std::vector<std::string> all;
    for (const auto& item : detail::linears_of(model)) all.push_back(item.first);
    detail::convert_layers(model, all, reference, 0);
  };
}

// A fresh model holding `source`'s weights, `prepare`d (a layer converted,
// or a plan applied), trained options.steps() steps and evaluated.
ProbeResult run_probe(torch::nn::Module& source, const MeasureProblem& problem,
                      const MeasureOptions& options,
                      const std::function<void(torch::nn::Module&)>& prepare,
                      const std::vector<std::string>& grad_layers) {
  torch::manual_seed(static_cast<uint64_t>(options.seed()));
  std::shared_ptr<torch::nn::Module> model = problem.make_model();
  TORCH_CHECK_VALUE(model != nullptr, "ampx::plan: MeasureProblem::make_model returned null");
  detail::copy_weights(source, *model);
  prepare(*model);
  const auto params = model->parameters();
  TORCH_CHECK_VALUE(!params.empty(), "ampx::plan: the model has no parameters");
  const c10::DeviceType device = params.front().device().type();
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(options.lr()));
  ProbeResult result;
  model->train();
  for (int64_t step = 0; step < options.steps(); ++step) {
    optimizer.zero_grad();
    region_loss(*model, problem, step, device).backward();
    if (step == 0) {
      const auto linears = detail::linears_of(*model);
      for (const auto& name : grad_layers) {
        const at::Tensor& g = detail::find_linear(linears, name, "measure")->weight.grad();
        result.first_grads[name] = g.defined() ? g.detach().to(at::kFloat).clone() : at::Tensor();
      }
    }
    optimizer.step();
  }
  model->eval();
  torch::NoGradGuard no_grad;
  double sum = 0;
  for (int64_t e = 0; e < options.eval_batches(); ++e) {
    sum += region_loss(*model, problem, options.steps() + e, device).item<double>();
  }
  result.eval_loss = sum / static_cast<double>(options.eval_batches());
  return result;
}

double relative_change(double loss, double reference) {
  const double denominator = std::abs(reference) > 0 ? std::abs(reference) : 1.0;
  return (loss - reference) / denominator;
}

double relative_error(const at::Tensor& g, const at::Tensor& reference) {
  if (!g.defined() || !reference.defined()) return 0;
  const double norm = reference.norm().item<double>();
  const double diff = (g - reference).norm().item<double>();
  return norm > 0 ? diff / norm : diff;
}

}  // namespace

Measurement measure_layers(torch::nn::Module& model, const MeasureProblem& problem,
                           const MeasureOptions& options) {
  check_problem(problem, options);
  const auto start = std::chrono::steady_clock::now();
  Measurement m;
  m.steps = options.steps();
  m.eval_batches = options.eval_batches();
  m.seed = options.seed();
  m.reference = options.reference();
  double total_flops = 0;
  std::vector<std::string> names;
  for (const auto& [name, linear] : detail::linears_of(model)) {
    LayerMeasurement layer;
    layer.module = name;
    layer.in_features = linear->options.in_features();
    layer.out_features = linear->options.out_features();
    // Three products (forward, input gradient, weight gradient) of 2*in*out*tokens.
    layer.flops = 3.0 * 2.0 * static_cast<double>(layer.in_features) *
                  static_cast<double>(layer.out_features) *
                  static_cast<double>(options.tokens_per_step());
    layer.weight_amax = linear->weight.detach().abs().max().item<double>();
    total_flops += layer.flops;
    names.push_back(name);
    m.layers.push_back(std::move(layer));
  }
  TORCH_CHECK_VALUE(!m.layers.empty(), "ampx::plan::measure_layers: the model has no Linear");
  const ProbeResult reference =
      run_probe(model, problem, options, reference_formats(options.reference()), names);
  m.reference_loss = reference.eval_loss;
  m.probes = 1;
  for (auto& layer : m.layers) {
    layer.flops_share = layer.flops / total_flops;
    layer.formats.push_back({options.reference(), 0.0, 0.0});  // the reference itself
    const bool fp8_eligible = detail::fp8_eligible(layer.in_features, layer.out_features);
    for (const LayerFormat format : options.formats()) {
      if (format == options.reference() || (detail::is_fp8(format) && !fp8_eligible)) continue;
      const std::string path = layer.module;
      const ProbeResult r = run_probe(
          model, problem, options,
          probe_formats(options.reference(), path, format, options.seed()), {path});
      ++m.probes;
      layer.formats.push_back(
          {format, relative_change(r.eval_loss, m.reference_loss),
           relative_error(r.first_grads.at(path), reference.first_grads.at(path))});
    }
  }
  m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (options.steps_per_epoch() > 0) {
    m.epoch_fraction = static_cast<double>(m.probes * (options.steps() + options.eval_batches())) /
                       static_cast<double>(options.steps_per_epoch());
  }
  return m;
}

namespace {

// The proof run of `plan` against a reference loss already run.
PlanCheck proof_run(torch::nn::Module& model, const MeasureProblem& problem,
                    const PrecisionPlan& plan, const MeasureOptions& options,
                    double reference_loss) {
  PlanCheck check;
  check.reference_loss = reference_loss;
  const auto apply = [&](torch::nn::Module& probe) { apply_plan(probe, plan, options.seed()); };
  check.loss = run_probe(model, problem, options, apply, {}).eval_loss;
  check.loss_change = relative_change(check.loss, check.reference_loss);
  return check;
}

double run_reference(torch::nn::Module& model, const MeasureProblem& problem,
                     const MeasureOptions& options) {
  return run_probe(model, problem, options, reference_formats(options.reference()), {})
      .eval_loss;
}

void check_reference(LayerFormat planned, const MeasureOptions& options, const char* caller) {
  TORCH_CHECK_VALUE(planned == options.reference(), "ampx::plan::", caller,
                    ": the plan was made against a ", to_string(planned),
                    " reference, MeasureOptions::reference is ", to_string(options.reference()));
}

}  // namespace

PlanCheck check_plan(torch::nn::Module& model, const MeasureProblem& problem,
                     const PrecisionPlan& plan, const MeasureOptions& options) {
  check_problem(problem, options);
  check_reference(plan.reference, options, "check_plan");
  return proof_run(model, problem, plan, options, run_reference(model, problem, options));
}

ProvenPlan prove_plan(torch::nn::Module& model, const MeasureProblem& problem,
                      const Measurement& measurement, const PlanOptions& options,
                      const MeasureOptions& measure_options, int64_t max_rounds) {
  TORCH_CHECK_VALUE(max_rounds >= 1, "ampx::plan::prove_plan: max_rounds must be >= 1, got ",
                    max_rounds);
  check_problem(problem, measure_options);
  check_reference(measurement.reference, measure_options, "prove_plan");
  const double reference = run_reference(model, problem, measure_options);  // once: every round's
  const double budget = options.loss_budget();
  PlanOptions round = options;
  ProvenPlan proven;
  for (proven.rounds = 1; proven.rounds <= max_rounds; ++proven.rounds) {
    try {
      proven.plan = make_plan(measurement, round);
    } catch (const c10::ValueError&) {
      if (proven.rounds == 1) throw;  // the user's budget: the error is theirs to see
      --proven.rounds;                // the floors' layers alone exceed the smaller budget
      break;
    }
    proven.planned_budget = round.loss_budget();
    proven.check = proof_run(model, problem, proven.plan, measure_options, reference);
    if (proven.check.loss_change <= budget) break;
    // Smaller than both the budget and the prediction that missed, in the
    // proportion the proof run missed by.
    const double missed = budget / proven.check.loss_change;
    round.loss_budget(0.9 * std::min(round.loss_budget(), proven.plan.predicted_loss_change) *
                      missed);
    if (!(round.loss_budget() > 0)) break;  // a prediction of 0: nothing narrower to drop
  }
  if (proven.check.loss_change > budget) {
    // Every Linear in the reference's format: the reference itself; a layer
    // whose floor is wider than the reference (fp32 over bf16) in the formats
    // its floor allows, whatever their loss change.
    Measurement reference_only = measurement;
    const int reference_bits = element_bits(measurement.reference);
    double wider_changes = 0;
    for (auto& layer : reference_only.layers) {
      const Floor* floor = detail::binding_floor(layer.module, options.floors());
      const int floor_bits = floor ? element_bits(floor->format) : 0;
      const bool forced = floor_bits > reference_bits;
      layer.formats.erase(std::remove_if(layer.formats.begin(), layer.formats.end(),
                                         [&](const FormatMeasurement& f) {
                                           return forced ? element_bits(f.format) < floor_bits
                                                         : f.format != measurement.reference;
                                         }),
                          layer.formats.end());
      double most = 0;
      for (const auto& f : layer.formats) most = std::max(most, f.loss_change);
      wider_changes += most;
    }
    // Room for all of them: the solver rounds each layer's change up by at
    // most one of its steps, so one more step per layer.
    const auto steps = static_cast<double>(round.budget_steps());
    const auto layers = static_cast<double>(reference_only.layers.size());
    round.budget_steps(round.budget_steps() + static_cast<int64_t>(layers));
    round.loss_budget((budget + wider_changes) * (steps + layers) / steps);
    proven.plan = make_plan(reference_only, round);
    proven.planned_budget = 0;
    proven.check = proof_run(model, problem, proven.plan, measure_options, reference);
    proven.rounds = std::min(proven.rounds, max_rounds) + 1;
  }
  proven.plan.loss_budget = budget;
  return proven;
}

}  // namespace plan
}  // namespace ampx
