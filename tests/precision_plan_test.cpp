// Automatic per-layer precision (ampx/precision_plan.h): the solver against
// brute force, and measurement, plan, apply and proof on a real training run
// of a small MLP classifying a random teacher network's labels.

#include "ampx/precision_plan.h"

#include "ampx/detail/plan_solver.h"
#include "ampx/fp8/autocast.h"
#include "ampx/fp8/convert.h"
#include "test_util.h"

#include <torch/torch.h>

#include <unistd.h>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>

namespace ampx {
namespace {

using plan::LayerFormat;
using ::testing::HasSubstr;

// Four Linears, all multiples of 16 (every format applies).
struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(32, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 64))),
        fc3(register_module("fc3", torch::nn::Linear(64, 64))),
        head(register_module("head", torch::nn::Linear(64, 16))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::gelu(fc1->forward(x));
    h = torch::gelu(fc2->forward(h));
    h = torch::gelu(fc3->forward(h));
    return head->forward(h).to(torch::kFloat);
  }
  torch::nn::Linear fc1, fc2, fc3, head;
};
TORCH_MODULE(Mlp);

// Batches of 64 rows (NVFP4's Hadamard transform takes multiples of 16),
// labels from a fixed random teacher: a real learning problem.
class TeacherData {
 public:
  explicit TeacherData(int64_t batches) {
    torch::manual_seed(1234);
    const auto w1 = torch::randn({32, 48});
    const auto w2 = torch::randn({48, 16});
    for (int64_t i = 0; i < batches; ++i) {
      inputs_.push_back(torch::randn({64, 32}));
      targets_.push_back(torch::tanh(inputs_.back().mm(w1)).mm(w2).argmax(1));
    }
  }
  torch::Tensor loss(torch::nn::Module& model, int64_t step) const {
    auto& mlp = dynamic_cast<MlpImpl&>(model);
    const auto i = static_cast<size_t>(step) % inputs_.size();
    return torch::cross_entropy_loss(mlp.forward(inputs_[i]), targets_[i]);
  }

 private:
  std::vector<torch::Tensor> inputs_, targets_;
};

plan::MeasureProblem problem_of(const TeacherData& data) {
  plan::MeasureProblem p;
  p.make_model = [] { return Mlp().ptr(); };
  p.loss = [&data](torch::nn::Module& m, int64_t step) { return data.loss(m, step); };
  return p;
}

plan::MeasureOptions measure_options() {
  return plan::MeasureOptions().steps(6).eval_batches(4).lr(3e-3).seed(7).tokens_per_step(64);
}

const plan::FormatMeasurement& measured(const plan::LayerMeasurement& layer, LayerFormat f) {
  for (const auto& m : layer.formats) {
    if (m.format == f) return m;
  }
  throw std::runtime_error("format not measured: " + plan::to_string(f));
}

// Brute force over every assignment: the least cost whose summed (clamped)
// weights fit, -1 when none does.
double brute_force(const std::vector<std::vector<double>>& w,
                   const std::vector<std::vector<double>>& c, double capacity) {
  double best = -1;
  std::vector<size_t> pick(w.size(), 0);
  while (true) {
    double weight = 0, cost = 0;
    for (size_t g = 0; g < w.size(); ++g) {
      weight += std::max(0.0, w[g][pick[g]]);
      cost += c[g][pick[g]];
    }
    if (weight <= capacity * (1 + 1e-12) && (best < 0 || cost < best)) best = cost;
    size_t g = 0;
    while (g < w.size() && ++pick[g] == w[g].size()) pick[g++] = 0;
    if (g == w.size()) return best;
  }
}

// The exact solver finds brute force's optimum on random instances whose
// weights lie on its budget grid, and on arbitrary weights a plan that truly
// fits, no worse than brute force's optimum within the budget less one step
// per group (what rounding up can cost).
TEST(PrecisionPlanTest, SolverMatchesBruteForceOnRandomInstances) {
  std::mt19937 rng(42);
  for (int instance = 0; instance < 300; ++instance) {
    const size_t groups = 1 + rng() % 5;
    const int64_t steps = 20 + static_cast<int64_t>(rng() % 30);
    const double capacity = 0.01;
    const double unit = capacity / static_cast<double>(steps);
    const bool on_grid = instance % 2 == 0;
    std::vector<std::vector<double>> w(groups), c(groups);
    for (size_t g = 0; g < groups; ++g) {
      const size_t options = 1 + rng() % 4;
      for (size_t i = 0; i < options; ++i) {
        const double x = std::uniform_real_distribution<double>(-0.1, 0.6)(rng);
        w[g].push_back(on_grid ? unit * std::round(x * static_cast<double>(steps)) : capacity * x);
        c[g].push_back(std::uniform_real_distribution<double>(0.1, 1.0)(rng));
      }
      w[g][0] = 0;  // at least one plan fits: the first options
    }
    const double best = brute_force(w, c, capacity);
    const auto pick = plan::solve_multiple_choice(w, c, capacity, steps);
    double weight = 0, cost = 0;
    for (size_t g = 0; g < groups; ++g) {
      weight += std::max(0.0, w[g][pick[g]]);
      cost += c[g][pick[g]];
    }
    ASSERT_LE(weight, capacity * (1 + 1e-9)) << "instance " << instance;
    if (on_grid) {
      ASSERT_NEAR(cost, best, 1e-9) << "instance " << instance;
    } else {
      ASSERT_GE(cost, best - 1e-9) << "instance " << instance;
      const double tighter = brute_force(w, c, capacity - unit * static_cast<double>(groups));
      if (tighter >= 0) {
        ASSERT_LE(cost, tighter + 1e-9) << "instance " << instance;
      }
    }
  }
}

// A layer measured by hand: `share` of the Linear FLOPs, a loss change per format.
plan::LayerMeasurement layer_of(const std::string& module, double share,
                                std::vector<plan::FormatMeasurement> formats) {
  plan::LayerMeasurement layer;
  layer.module = module;
  layer.in_features = 64;
  layer.out_features = 64;
  layer.flops_share = share;
  layer.formats = std::move(formats);
  return layer;
}

// The solver rounds each loss change up onto its grid (the budget cut into
// budget_steps), so that a plan within the budget on the grid is within it
// in real numbers: changes of 3 and 5 steps fill a budget of 8 exactly and
// both layers take NVFP4; 3 steps and a hair (a millionth of a step, beyond
// the 1e-9 of a step the solver forgives as floating-point noise) and 5
// steps do not fit together, and the cheaper plan that fits is taken: the
// larger layer in NVFP4.
TEST(PrecisionPlanTest, SolverRoundsEachLossChangeUpOntoTheBudgetGrid) {
  const double budget = 1.0 / 128, step = budget / 8;  // powers of two: the grid is exact
  const double hair = 1e-6 * step;
  const auto two_layers = [&](double a_change) {
    plan::Measurement m;
    m.layers = {
        layer_of("a", 0.25, {{LayerFormat::kBFloat16, 0, 0}, {LayerFormat::kNvfp4, a_change, 0}}),
        layer_of("b", 0.75, {{LayerFormat::kBFloat16, 0, 0}, {LayerFormat::kNvfp4, 5 * step, 0}})};
    return m;
  };
  const auto options = plan::PlanOptions(budget).budget_steps(8);
  const auto filled = plan::make_plan(two_layers(3 * step), options);
  EXPECT_EQ(filled.layers[0].format, LayerFormat::kNvfp4);
  EXPECT_EQ(filled.layers[1].format, LayerFormat::kNvfp4);
  EXPECT_EQ(filled.predicted_loss_change, budget);

  const auto over = plan::make_plan(two_layers(3 * step + hair), options);
  EXPECT_EQ(over.layers[0].format, LayerFormat::kBFloat16);
  EXPECT_EQ(over.layers[1].format, LayerFormat::kNvfp4);
  EXPECT_LE(over.predicted_loss_change, budget);
  EXPECT_EQ(over.predicted_loss_change, 5 * step);
  // The solver itself: the same choice.
  EXPECT_EQ(plan::solve_multiple_choice({{0, 3 * step + hair}, {0, 5 * step}},
                                        {{0.25, 0.0625}, {0.75, 0.1875}}, budget, 8),
            (std::vector<size_t>{0, 1}));
  EXPECT_EQ(plan::solve_multiple_choice({{0, 3 * step}, {0, 5 * step}},
                                        {{0.25, 0.0625}, {0.75, 0.1875}}, budget, 8),
            (std::vector<size_t>{1, 1}));
}

// The model every training test measures: fresh weights from seed 0, then
// trained 20 bf16 steps (the plan is made from a model in training).
Mlp trained_model(const TeacherData& data) {
  torch::manual_seed(0);
  Mlp model;
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3));
  for (int64_t step = 0; step < 20; ++step) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      loss = data.loss(*model, 100 + step);
    }
    loss.backward();
    opt.step();
  }
  return model;
}

struct Measured {
  TeacherData data{128};
  Mlp model = trained_model(data);
  plan::Measurement m = plan::measure_layers(*model, problem_of(data), measure_options());
};

// Measured once for the tests below (the first checks it is deterministic).
Measured& measured_mlp() {
  static Measured* const m = new Measured();
  return *m;
}

// What the user's own loop gives from the measured model's weights: 6 AdamW
// steps on batches 0..5, then the mean loss of batches 6..9, under bf16
// autocast or in float32.
double users_loop(Measured& fx, bool bf16_autocast) {
  Mlp copy;
  {
    torch::NoGradGuard no_grad;
    const auto source = fx.model->named_parameters();
    for (auto& p : copy->named_parameters()) p.value().copy_(source[p.key()]);
  }
  torch::optim::AdamW opt(copy->parameters(), torch::optim::AdamWOptions(3e-3));
  for (int64_t step = 0; step < 6; ++step) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      AutocastGuard autocast(torch::kCPU, torch::kBFloat16, bf16_autocast);
      loss = fx.data.loss(*copy, step);
    }
    loss.backward();
    opt.step();
  }
  torch::NoGradGuard no_grad;
  AutocastGuard autocast(torch::kCPU, torch::kBFloat16, bf16_autocast);
  double eval = 0;
  for (int64_t e = 0; e < 4; ++e) eval += fx.data.loss(*copy, 6 + e).item<double>();
  return eval / 4;
}

// Every Linear in every format; the same numbers on a second pass; 4-bit
// gradients further from bf16's than 8-bit ones; the reference is what the
// user's own bf16 loop gives from the model's weights.
TEST(PrecisionPlanTest, MeasurementIsDeterministicAndTheReferenceIsTheUsersLoop) {
  Measured& fx = measured_mlp();
  const plan::Measurement& a = fx.m;
  const plan::Measurement b =
      plan::measure_layers(*fx.model, problem_of(fx.data), measure_options());
  ASSERT_EQ(a.layers.size(), 4u);
  EXPECT_EQ(a.reference, LayerFormat::kBFloat16);
  EXPECT_EQ(a.probes, 1 + 4 * 6);  // the reference, then fp32, fp16 and 4 FP8/FP4 formats a layer
  EXPECT_GT(a.seconds, 0.0);
  EXPECT_EQ(a.reference_loss, b.reference_loss);
  const std::vector<std::string> names{"fc1", "fc2", "fc3", "head"};
  const double total = 32 * 64 + 64 * 64 * 2 + 64 * 16;
  for (size_t l = 0; l < 4; ++l) {
    const auto& la = a.layers[l];
    EXPECT_EQ(la.module, names[l]);
    EXPECT_DOUBLE_EQ(la.flops_share, la.in_features * la.out_features / total);
    EXPECT_DOUBLE_EQ(la.flops, 6.0 * la.in_features * la.out_features * 64);
    ASSERT_EQ(la.formats.size(), 7u) << la.module;
    EXPECT_EQ(la.formats[0].format, LayerFormat::kBFloat16);  // the reference
    for (size_t f = 0; f < 7; ++f) {
      EXPECT_EQ(la.formats[f].loss_change, b.layers[l].formats[f].loss_change) << la.module;
      EXPECT_EQ(la.formats[f].grad_error, b.layers[l].formats[f].grad_error) << la.module;
    }
    const double nvfp4 = measured(la, LayerFormat::kNvfp4).grad_error;
    EXPECT_GT(nvfp4, measured(la, LayerFormat::kFp8).grad_error) << la.module;
    EXPECT_GT(nvfp4, measured(la, LayerFormat::kMxfp8).grad_error) << la.module;
    EXPECT_GT(measured(la, LayerFormat::kFp8).grad_error, 0.0) << la.module;
  }
  // The reference: 6 AdamW steps of the model's own weights under bf16 autocast.
  EXPECT_EQ(a.reference_loss, users_loop(fx, /*bf16_autocast=*/true));
}

// The budget the training tests plan for: 0.3% of the loss.
constexpr double kBudget = 0.003;

bool has_format(const plan::PrecisionPlan& p, LayerFormat f) {
  return std::any_of(p.layers.begin(), p.layers.end(),
                     [f](const plan::LayerPlan& l) { return l.format == f; });
}

// The plan fits its budget in the additive model, and prove_plan's on
// training: its proof run (the same steps and batches as the probes) stays
// within the budget, re-planned for less where the additive model missed the
// layers' interactions (LibTorch 2.15's numbers trained the first B200 plan,
// predicted +0.19%, to +0.32%); it is faster than bf16 on B200 and H100
// (which runs no FP4 or MX).
TEST(PrecisionPlanTest, PlanWithinBudgetHoldsOnTrainingAndIsFasterThanBf16) {
  Measured& fx = measured_mlp();
  const auto first = plan::make_plan(fx.m, plan::PlanOptions(kBudget));
  EXPECT_EQ(first.target, "b200");
  EXPECT_LE(first.predicted_loss_change, kBudget);
  const auto b200 = plan::prove_plan(*fx.model, problem_of(fx.data), fx.m,
                                     plan::PlanOptions(kBudget), measure_options());
  EXPECT_EQ(b200.plan.loss_budget, kBudget);
  EXPECT_EQ(b200.check.reference_loss, fx.m.reference_loss);
  EXPECT_LE(b200.check.loss_change, kBudget);
  EXPECT_LE(b200.plan.predicted_loss_change, b200.planned_budget);
  if (b200.rounds == 1) {
    EXPECT_EQ(b200.plan.cost, first.cost);
  }
  EXPECT_LT(b200.plan.cost, 0.5 * b200.plan.bf16_cost);  // FP8 at least everywhere, FP4 somewhere
  EXPECT_TRUE(has_format(b200.plan, LayerFormat::kNvfp4));
  EXPECT_GT(b200.check.loss, b200.check.reference_loss);  // FP4 layers cost something, measurably

  const auto h100 =
      plan::prove_plan(*fx.model, problem_of(fx.data), fx.m,
                       plan::PlanOptions(kBudget).cost_model(plan::cost_model_for("h100")),
                       measure_options());
  EXPECT_FALSE(has_format(h100.plan, LayerFormat::kNvfp4));
  EXPECT_FALSE(has_format(h100.plan, LayerFormat::kMxfp8));
  EXPECT_LT(h100.plan.cost, h100.plan.bf16_cost);
  EXPECT_LE(h100.check.loss_change, kBudget);
}

// Issue 44's planted mismeasurement: the layer most sensitive to NVFP4
// reported as insensitive (loss change 0 in every format) goes to the
// narrowest format, the plan's proof run leaves the budget, and prove_plan
// catches it and plans again for less. Which of the honest and the wrong
// plan trains closer to bf16 is not promised (on a Zen 4 the wrong one did,
// by 0.000015): only what each plan and the proof promise is asserted.
TEST(PrecisionPlanTest, PlantedZeroSensitivityGoesToNvfp4AndTheProofRunLeavesTheBudget) {
  Measured& fx = measured_mlp();
  size_t worst = 0;
  for (size_t l = 0; l < fx.m.layers.size(); ++l) {
    if (measured(fx.m.layers[l], LayerFormat::kNvfp4).loss_change >
        measured(fx.m.layers[worst], LayerFormat::kNvfp4).loss_change) {
      worst = l;
    }
  }
  // The budget sits below the worst layer's own NVFP4 change, whatever the
  // running LibTorch's numbers are, so that layer alone would break it.
  const double worst_change = measured(fx.m.layers[worst], LayerFormat::kNvfp4).loss_change;
  ASSERT_GT(worst_change, 0) << fx.m.layers[worst].module;
  const double budget = 0.8 * worst_change;
  const auto honest = plan::make_plan(fx.m, plan::PlanOptions(budget));
  EXPECT_NE(honest.layers[worst].format, LayerFormat::kNvfp4) << fx.m.layers[worst].module;
  EXPECT_LE(honest.predicted_loss_change, budget);

  plan::Measurement planted = fx.m;
  for (auto& f : planted.layers[worst].formats) f.loss_change = 0;
  const auto wrong = plan::make_plan(planted, plan::PlanOptions(budget));
  EXPECT_EQ(wrong.layers[worst].format, LayerFormat::kNvfp4);
  EXPECT_LE(wrong.predicted_loss_change, budget);  // the model believes it
  const auto wrong_check =
      plan::check_plan(*fx.model, problem_of(fx.data), wrong, measure_options());
  EXPECT_GT(wrong_check.loss_change, budget) << "predicted " << wrong.predicted_loss_change;
  // prove_plan's proof run catches the mismeasurement and plans again.
  const auto proven = plan::prove_plan(*fx.model, problem_of(fx.data), planted,
                                       plan::PlanOptions(budget), measure_options());
  EXPECT_GT(proven.rounds, 1);
  EXPECT_EQ(proven.plan.loss_budget, budget);
  EXPECT_LE(proven.check.loss_change, budget);
  EXPECT_LT(proven.planned_budget, budget);
  EXPECT_LE(proven.plan.predicted_loss_change, proven.planned_budget);
}

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream(p) << text;
}

struct TempFolder {
  std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("ampx-plan-" + std::to_string(::getpid()));
  TempFolder() { std::filesystem::create_directories(path); }
  ~TempFolder() { std::filesystem::remove_all(path); }
};

// save -> load gives the same plan, saving it again the same bytes; the
// loaded plan converts each layer to its format and trains as the original.
TEST(PrecisionPlanTest, SavedPlanLoadsBackAndAppliesAsTheOriginal) {
  Measured& fx = measured_mlp();
  TempFolder tmp;
  const auto original = plan::make_plan(fx.m, plan::PlanOptions(kBudget));
  plan::save_plan(original, (tmp.path / "a.json").string());
  const auto loaded = plan::load_plan((tmp.path / "a.json").string());
  plan::save_plan(loaded, (tmp.path / "b.json").string());
  EXPECT_EQ(read_text(tmp.path / "a.json"), read_text(tmp.path / "b.json"));
  EXPECT_THAT(read_text(tmp.path / "a.json"), HasSubstr("\n      \"format\": \"nvfp4\",\n"));
  // A bf16-reference plan without wide layers: version 1, which older ampx reads.
  EXPECT_THAT(read_text(tmp.path / "a.json"), HasSubstr("{\n  \"version\": 1,\n"));
  EXPECT_EQ(loaded.target, original.target);
  EXPECT_EQ(loaded.reference, LayerFormat::kBFloat16);  // version 1: bf16
  EXPECT_EQ(loaded.loss_budget, original.loss_budget);
  EXPECT_EQ(loaded.cost, original.cost);
  ASSERT_EQ(loaded.layers.size(), original.layers.size());
  for (size_t l = 0; l < loaded.layers.size(); ++l) {
    EXPECT_EQ(loaded.layers[l].module, original.layers[l].module);
    EXPECT_EQ(loaded.layers[l].format, original.layers[l].format);
    EXPECT_EQ(loaded.layers[l].loss_change, original.layers[l].loss_change);
    EXPECT_EQ(loaded.layers[l].reason, original.layers[l].reason);
  }
  Mlp fresh;
  const auto converted = plan::apply_plan(*fresh, loaded, 7);
  const auto modules = fresh->named_modules();
  for (const auto& l : loaded.layers) {
    const auto scaling = fp8::scaling_of(*modules[l.module]);
    const bool listed = std::find(converted.begin(), converted.end(), l.module) != converted.end();
    EXPECT_EQ(listed, l.format != LayerFormat::kBFloat16) << l.module;
    EXPECT_EQ(scaling != nullptr, listed) << l.module;
    if (scaling) {
      EXPECT_EQ(scaling->recipe.to_string(), plan::scale_rule_of(l.format, 7));
    }
  }
  EXPECT_EQ(plan::check_plan(*fx.model, problem_of(fx.data), loaded, measure_options()).loss,
            plan::check_plan(*fx.model, problem_of(fx.data), original, measure_options()).loss);
}

// Bad input names the argument and the value.
TEST(PrecisionPlanTest, BadInputGetsErrorsNamingTheArgumentAndValue) {
  Measured& fx = measured_mlp();
  TempFolder tmp;
  EXPECT_THAT(test::error_text([&] { (void)plan::make_plan(fx.m, plan::PlanOptions(0)); }),
              HasSubstr("loss_budget must be > 0, got 0"));
  EXPECT_THAT(test::error_text([&] { (void)plan::make_plan(fx.m, plan::PlanOptions(-0.5)); }),
              HasSubstr("loss_budget must be > 0, got -0.5"));
  EXPECT_THAT(test::error_text([&] {
                (void)plan::prove_plan(*fx.model, problem_of(fx.data), fx.m,
                                       plan::PlanOptions(kBudget), measure_options(), 0);
              }),
              HasSubstr("max_rounds must be >= 1, got 0"));
  EXPECT_THAT(test::error_text([] { (void)plan::cost_model_for("a100"); }),
              HasSubstr("target 'a100' has no cost model (h100, b200, cpu)"));
  EXPECT_THAT(test::error_text([] { (void)plan::parse_layer_format("fp5", "--format"); }),
              HasSubstr("--format 'fp5' is not a layer format"));

  const auto p = plan::make_plan(fx.m, plan::PlanOptions(kBudget));
  const auto good = tmp.path / "good.json";
  plan::save_plan(p, good.string());
  const std::string text = read_text(good);
  const auto edited = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    const auto at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    t.replace(at, from.size(), to);
    const auto path = tmp.path / "edited.json";
    write_text(path, t);
    return path.string();
  };
  // An unknown module: loads, and apply_plan names it and the model's Linears.
  const auto unknown = plan::load_plan(edited("\"module\": \"fc2\"", "\"module\": \"fc9\""));
  Mlp fresh;
  EXPECT_THAT(test::error_text([&] { (void)plan::apply_plan(*fresh, unknown); }),
              HasSubstr("module 'fc9' is not a Linear of the model (its Linears: fc1, fc2, fc3, "
                        "head)"));
  const std::string head = "\"module\": \"head\",\n      \"format\": \"";
  const auto bad_format = edited(head + plan::to_string(p.layers[3].format) + "\"", head + "fp5\"");
  EXPECT_THAT(test::error_text([&] { (void)plan::load_plan(bad_format); }),
              HasSubstr("'" + bad_format + "': key 'layers[3].format' has value 'fp5'"));
  const auto bad_budget = edited("\"loss_budget\": 0.0030000000000000001", "\"loss_budget\": -1");
  EXPECT_THAT(test::error_text([&] { (void)plan::load_plan(bad_budget); }),
              HasSubstr("key 'loss_budget' has value -1, must be > 0"));
  const auto corrupt = tmp.path / "corrupt.json";
  write_text(corrupt, text.substr(0, text.size() / 2));
  EXPECT_THAT(test::error_text([&] { (void)plan::load_plan(corrupt.string()); }),
              HasSubstr("'" + corrupt.string() + "': not valid JSON at byte"));
  const auto typo = edited("\"grad_error\"", "\"grad_eror\"");
  EXPECT_THAT(test::error_text([&] { (void)plan::load_plan(typo); }),
              HasSubstr("key 'layers[0].grad_error' is missing"));
  EXPECT_THAT(test::error_text([&] { (void)plan::load_plan((tmp.path / "none.json").string()); }),
              HasSubstr("cannot read '" + (tmp.path / "none.json").string() + "'"));
  // The same file's text, parsed: the same plan; errors name the source given.
  const auto parsed = plan::parse_plan(text, "mine");
  const auto loaded = plan::load_plan(good.string());
  ASSERT_EQ(parsed.layers.size(), loaded.layers.size());
  for (size_t i = 0; i < parsed.layers.size(); ++i) {
    EXPECT_EQ(parsed.layers[i].module, loaded.layers[i].module);
    EXPECT_EQ(parsed.layers[i].format, loaded.layers[i].format);
  }
  EXPECT_EQ(parsed.cost, loaded.cost);
  EXPECT_THAT(test::error_text([&] { (void)plan::parse_plan(text.substr(0, 10), "mine"); }),
              HasSubstr("ampx::plan::parse_plan: 'mine': not valid JSON at byte"));
}

// Against an fp32 reference (every Linear in float32) bf16 is a format
// like the others: the reference is the user's own float32 loop; fp16's
// gradients are nearer float32's than bf16's; a budget below a layer's
// bf16 loss change keeps that layer out of bf16, and the plan's proof run
// holds; the plan file keeps its reference; a proof against another
// reference is refused.
TEST(PrecisionPlanTest, Fp32ReferenceMeasuresBf16AndKeepsSensitiveLayersWide) {
  Measured& fx = measured_mlp();
  const auto options = measure_options().reference(LayerFormat::kFloat32);
  const auto m = plan::measure_layers(*fx.model, problem_of(fx.data), options);
  EXPECT_EQ(m.reference, LayerFormat::kFloat32);
  EXPECT_EQ(m.probes, 1 + 4 * 6);
  for (const auto& layer : m.layers) {
    ASSERT_EQ(layer.formats.size(), 7u) << layer.module;
    EXPECT_EQ(layer.formats[0].format, LayerFormat::kFloat32);
    EXPECT_EQ(layer.formats[0].loss_change, 0.0);
    EXPECT_LT(measured(layer, LayerFormat::kFloat16).grad_error,
              measured(layer, LayerFormat::kBFloat16).grad_error)
        << layer.module;
  }
  // The reference: 6 AdamW steps of the model's own weights in float32 (the
  // MLP's other ops, GELU and the loss, run in float32 under autocast too).
  EXPECT_EQ(m.reference_loss, users_loop(fx, /*bf16_autocast=*/false));

  // The layer bf16 costs most: a budget below its change keeps it wider.
  size_t worst = 0;
  for (size_t l = 0; l < m.layers.size(); ++l) {
    if (measured(m.layers[l], LayerFormat::kBFloat16).loss_change >
        measured(m.layers[worst], LayerFormat::kBFloat16).loss_change) {
      worst = l;
    }
  }
  const double bf16_change = measured(m.layers[worst], LayerFormat::kBFloat16).loss_change;
  ASSERT_GT(bf16_change, 0) << "bf16 costs no layer anything against float32";
  const double budget = 0.8 * bf16_change;
  const auto proven = plan::prove_plan(*fx.model, problem_of(fx.data), m,
                                       plan::PlanOptions(budget), options);
  EXPECT_EQ(proven.plan.reference, LayerFormat::kFloat32);
  // Alone it would spend more than the budget: another format (wider, or a
  // narrower one whose probe happened to cost less) takes that layer.
  EXPECT_NE(proven.plan.layers[worst].format, LayerFormat::kBFloat16) << m.layers[worst].module;
  EXPECT_LE(proven.plan.predicted_loss_change, budget);
  EXPECT_LE(proven.check.loss_change, budget);
  EXPECT_LT(proven.plan.cost, 30.0 * proven.plan.bf16_cost);  // cheaper than every Linear fp32

  TempFolder tmp;
  const auto path = (tmp.path / "fp32.json").string();
  plan::save_plan(proven.plan, path);
  EXPECT_THAT(read_text(path), HasSubstr("{\n  \"version\": 2,\n"));
  EXPECT_THAT(read_text(path), HasSubstr("\n  \"reference\": \"fp32\",\n"));
  plan::PrecisionPlan odd = proven.plan;
  odd.reference = LayerFormat::kNvfp4;
  EXPECT_THAT(test::error_text([&] { plan::save_plan(odd, path); }),
              HasSubstr("the plan's reference must be bf16 or fp32, got nvfp4"));
  const auto loaded = plan::load_plan(path);
  EXPECT_EQ(loaded.reference, LayerFormat::kFloat32);
  for (size_t l = 0; l < loaded.layers.size(); ++l) {
    EXPECT_EQ(loaded.layers[l].format, proven.plan.layers[l].format);
  }
  EXPECT_EQ(plan::check_plan(*fx.model, problem_of(fx.data), loaded, options).loss,
            proven.check.loss);
  // Version 1 (before fp32 references) had no fp32 or fp16 layers either:
  // such a file is refused by name.
  plan::PrecisionPlan with_fp16 = proven.plan;
  with_fp16.layers[0].format = LayerFormat::kFloat16;
  plan::save_plan(with_fp16, path);
  std::string v1 = read_text(path);
  const std::string version = "\"version\": 2", reference = "  \"reference\": \"fp32\",\n";
  ASSERT_NE(v1.find(version), std::string::npos);
  v1.replace(v1.find(version), version.size(), "\"version\": 1");
  v1.erase(v1.find(reference), reference.size());
  write_text(tmp.path / "v1.json", v1);
  EXPECT_THAT(test::error_text([&] { (void)plan::load_plan((tmp.path / "v1.json").string()); }),
              HasSubstr("key 'layers[0].format' has value 'fp16', which version 1 files do not "
                        "hold"));
  EXPECT_THAT(test::error_text([&] {
                (void)plan::check_plan(*fx.model, problem_of(fx.data), loaded, measure_options());
              }),
              HasSubstr("the plan was made against a fp32 reference, MeasureOptions::reference "
                        "is bf16"));
  EXPECT_THAT(test::error_text([&] {
                (void)plan::measure_layers(*fx.model, problem_of(fx.data),
                                           measure_options().reference(LayerFormat::kNvfp4));
              }),
              HasSubstr("MeasureOptions::reference must be bf16 or fp32, got nvfp4"));
}

// `steps` AdamW steps of `model` from `from`'s weights on batches 0.., each
// under bf16 autocast inside an FP8 region (as ampx-train runs a plan);
// `between(step)` runs before each. Returns the losses.
std::vector<double> train_planned(Mlp& model, Measured& from, int64_t steps,
                                  const std::function<void(int64_t)>& between) {
  {
    torch::NoGradGuard no_grad;
    const auto source = from.model->named_parameters();
    for (auto& p : model->named_parameters()) p.value().copy_(source[p.key()]);
  }
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3));
  std::vector<double> losses;
  for (int64_t step = 0; step < steps; ++step) {
    between(step);
    opt.zero_grad();
    torch::Tensor loss;
    {
      AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      fp8::Fp8AutocastGuard region;
      loss = from.data.loss(*model, step);
    }
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

// The plan's tail (NVIDIA's NVFP4 recipe's late switch): kept in the plan
// file (version 3), placed at the end of a run, counted in the run's
// modelled cost. Entering it puts every planned Linear in the reference's
// format: from there the model trains bit for bit as one never converted
// (bf16 reference) or one with every Linear planned fp32 (fp32 reference).
TEST(PrecisionPlanTest, TailIsKeptInThePlanFileAndTrainsInTheReferenceFormat) {
  Measured& fx = measured_mlp();
  TempFolder tmp;
  const auto plan = plan::make_plan(fx.m, plan::PlanOptions(kBudget).tail(0.1));
  EXPECT_EQ(plan.tail, 0.1);
  ASSERT_TRUE(has_format(plan, LayerFormat::kNvfp4));
  const auto path = (tmp.path / "tail.json").string();
  plan::save_plan(plan, path);
  const std::string text = read_text(path);
  EXPECT_THAT(text, HasSubstr("{\n  \"version\": 3,\n"));
  EXPECT_THAT(text, HasSubstr("\n  \"tail\": 0.10000000000000001,\n"));  // 0.1, 17 digits
  const auto loaded = plan::load_plan(path);
  EXPECT_EQ(loaded.tail, 0.1);
  plan::save_plan(loaded, (tmp.path / "again.json").string());
  EXPECT_EQ(read_text(tmp.path / "again.json"), text);

  EXPECT_EQ(plan::tail_start(plan, 200), 180);
  EXPECT_EQ(plan::tail_start(plan, 4), 4);  // 0.4 of a step: none
  EXPECT_EQ(plan::tail_start(plan::make_plan(fx.m, plan::PlanOptions(kBudget)), 200), 200);
  const auto b200 = plan::cost_model_for("b200");
  EXPECT_DOUBLE_EQ(plan::run_cost(plan, b200), 0.9 * plan.cost + 0.1 * plan.bf16_cost);
  auto against_fp32 = plan;
  against_fp32.reference = LayerFormat::kFloat32;
  EXPECT_DOUBLE_EQ(plan::run_cost(against_fp32, b200),
                   0.9 * plan.cost +
                       0.1 * plan.bf16_cost / b200.throughput.at(LayerFormat::kFloat32));

  // Training: with the tail entered before the first step, the plan's model
  // trains as one never converted; without it, in the plan's formats.
  Mlp tailed, plain, planned;
  (void)plan::apply_plan(*tailed, plan, 7);
  const auto in_tail = train_planned(tailed, fx, 4, [&](int64_t step) {
    if (step == 0) plan::enter_tail(*tailed, plan);
  });
  for (const auto& m : tailed->named_modules()) {
    EXPECT_EQ(fp8::scaling_of(*m.value()), nullptr) << m.key();
  }
  EXPECT_EQ(in_tail, train_planned(plain, fx, 4, [](int64_t) {}));
  EXPECT_TRUE(torch::equal(tailed->fc2->weight, plain->fc2->weight));
  (void)plan::apply_plan(*planned, plan, 7);
  EXPECT_NE(train_planned(planned, fx, 4, [](int64_t) {}), in_tail);

  // An fp32 reference: every Linear in float32 products, as a plan of fp32 layers.
  auto all_fp32 = plan;
  for (auto& l : all_fp32.layers) l.format = LayerFormat::kFloat32;
  Mlp tailed32, wide;
  (void)plan::apply_plan(*tailed32, against_fp32, 7);
  const auto in_tail32 = train_planned(tailed32, fx, 3, [&](int64_t step) {
    if (step == 0) plan::enter_tail(*tailed32, against_fp32);
  });
  (void)plan::apply_plan(*wide, all_fp32, 7);
  EXPECT_EQ(in_tail32, train_planned(wide, fx, 3, [](int64_t) {}));
  EXPECT_NE(in_tail32, in_tail);

  // Bad tails name themselves.
  EXPECT_THAT(test::error_text([&] {
                (void)plan::make_plan(fx.m, plan::PlanOptions(kBudget).tail(1));
              }),
              HasSubstr("make_plan: tail must be in [0, 1), got 1"));
  const auto edited = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    EXPECT_NE(t.find(from), std::string::npos) << from;
    t.replace(t.find(from), from.size(), to);
    write_text(tmp.path / "edited.json", t);
    return (tmp.path / "edited.json").string();
  };
  const auto out_of_range = edited("\"tail\": 0.10000000000000001", "\"tail\": 1.5");
  EXPECT_THAT(test::error_text([&] { (void)plan::load_plan(out_of_range); }),
              HasSubstr("key 'tail' has value 1.5, must be in [0, 1)"));
  const auto version_2 = edited("\"version\": 3", "\"version\": 2");
  EXPECT_THAT(test::error_text([&] { (void)plan::load_plan(version_2); }),
              HasSubstr("unknown key 'tail'"));
}

// A floor keeps the Linears under its prefix at or above its format's width
// (the published NVFP4 recipe's first and last blocks, by position): the
// floored layer leaves NVFP4 for an 8-bit format, and says why; the other
// layers are planned as before; two floors over a layer, the wider binds;
// the plan file keeps the floors (version 4) and refuses a layer below one;
// prove_plan keeps them through its rounds and its fallback.
TEST(PrecisionPlanTest, FloorsKeepTheirLayersAtOrAboveTheirWidth) {
  Measured& fx = measured_mlp();
  TempFolder tmp;
  const auto free = plan::make_plan(fx.m, plan::PlanOptions(kBudget));
  EXPECT_TRUE(free.floors.empty());
  size_t l = 0;
  while (l < free.layers.size() && free.layers[l].format != LayerFormat::kNvfp4) ++l;
  ASSERT_LT(l, free.layers.size());
  const std::string name = free.layers[l].module;
  const std::vector<plan::Floor> floors = {{name, LayerFormat::kFp8}};
  const auto floored = plan::make_plan(fx.m, plan::PlanOptions(kBudget).floors(floors));
  ASSERT_EQ(floored.floors.size(), 1u);
  EXPECT_EQ(floored.floors[0].prefix, name);
  EXPECT_EQ(plan::element_bits(floored.layers[l].format), 8) << name;
  EXPECT_THAT(floored.layers[l].reason,
              HasSubstr("the floor '" + name + "' keeps it at 8-bit elements or wider (fp8), "
                        "ruling out nvfp4"));
  EXPECT_GT(floored.cost, free.cost);  // the floor costs time: FP8's half of NVFP4's speed
  EXPECT_LE(floored.predicted_loss_change, kBudget);
  // Two floors over one layer: the wider binds.
  const std::vector<plan::Floor> two = {{name, LayerFormat::kFp8}, {name, LayerFormat::kBFloat16}};
  const auto both = plan::make_plan(fx.m, plan::PlanOptions(kBudget).floors(two));
  EXPECT_GE(plan::element_bits(both.layers[l].format), 16) << name;
  EXPECT_THAT(both.layers[l].reason, HasSubstr("the floor '" + name + "' keeps it at 16-bit"));

  // The file: version 4 with the floors, saved again byte for byte; an older
  // version has none; a layer below its floor is refused.
  const auto path = (tmp.path / "floored.json").string();
  plan::save_plan(floored, path);
  const std::string text = read_text(path);
  EXPECT_THAT(text, HasSubstr("{\n  \"version\": 4,\n"));
  EXPECT_THAT(text, HasSubstr("\n  \"floors\": [\n    {\"prefix\": \"" + name +
                              "\", \"format\": \"fp8\"}\n  ],\n"));
  const auto loaded = plan::load_plan(path);
  ASSERT_EQ(loaded.floors.size(), 1u);
  EXPECT_EQ(loaded.floors[0].prefix, name);
  EXPECT_EQ(loaded.floors[0].format, LayerFormat::kFp8);
  plan::save_plan(loaded, (tmp.path / "again.json").string());
  EXPECT_EQ(read_text(tmp.path / "again.json"), text);
  plan::save_plan(free, (tmp.path / "free.json").string());
  EXPECT_TRUE(plan::load_plan((tmp.path / "free.json").string()).floors.empty());
  auto narrowed = floored;
  narrowed.layers[l].format = LayerFormat::kNvfp4;
  EXPECT_THAT(test::error_text([&] { plan::save_plan(narrowed, (tmp.path / "n.json").string()); }),
              HasSubstr("save_plan: layer '" + name + "' is nvfp4, narrower than its floor '" +
                        name + "' (fp8)"));
  EXPECT_FALSE(std::filesystem::exists(tmp.path / "n.json"));
  std::string below = text;
  const std::string format_of_l =
      "\"module\": \"" + name + "\",\n      \"format\": \"" +
      plan::to_string(floored.layers[l].format) + "\"";
  ASSERT_NE(below.find(format_of_l), std::string::npos);
  below.replace(below.find(format_of_l), format_of_l.size(),
                "\"module\": \"" + name + "\",\n      \"format\": \"nvfp4\"");
  write_text(tmp.path / "below.json", below);
  EXPECT_THAT(test::error_text([&] { (void)plan::load_plan((tmp.path / "below.json").string()); }),
              HasSubstr("key 'layers[" + std::to_string(l) + "].format' has value 'nvfp4', "
                        "narrower than floors[0] ('" + name + "', fp8)"));

  // A prefix is a module path: "fc" holds none of fc1, fc2, fc3.
  EXPECT_THAT(test::error_text([&] {
                const std::vector<plan::Floor> fc = {{"fc", LayerFormat::kFp8}};
                (void)plan::make_plan(fx.m, plan::PlanOptions(kBudget).floors(fc));
              }),
              HasSubstr("the floor 'fc' (fp8) names no measured Linear (fc1, fc2, fc3, head)"));
  plan::CostModel narrow{"narrow", {{LayerFormat::kBFloat16, 1.0}, {LayerFormat::kNvfp4, 4.0}}, ""};
  EXPECT_THAT(test::error_text([&] {
                (void)plan::make_plan(fx.m, plan::PlanOptions(kBudget).cost_model(narrow).floors(
                                                {{"fc2", LayerFormat::kFloat32}}));
              }),
              HasSubstr("layer 'fc2' has no format the narrow cost model runs at or above its "
                        "floor 'fc2' (fp32)"));

  // prove_plan: a planted mismeasurement (the layer most sensitive to NVFP4
  // reported insensitive) with one round: the proof leaves the budget, and
  // the fallback keeps the floored layer in fp32, the rest in bf16, the
  // reference, even where the target runs fp32 faster (a CPU's timed model).
  size_t worst = 0;
  for (size_t i = 0; i < fx.m.layers.size(); ++i) {
    if (measured(fx.m.layers[i], LayerFormat::kNvfp4).loss_change >
        measured(fx.m.layers[worst], LayerFormat::kNvfp4).loss_change) {
      worst = i;
    }
  }
  const size_t kept = worst == 0 ? 1 : 0;
  const double budget = 0.8 * measured(fx.m.layers[worst], LayerFormat::kNvfp4).loss_change;
  ASSERT_LT(measured(fx.m.layers[kept], LayerFormat::kFloat32).loss_change, budget);
  plan::Measurement planted = fx.m;
  for (auto& f : planted.layers[worst].formats) f.loss_change = 0;
  const std::vector<plan::Floor> wide = {{fx.m.layers[kept].module, LayerFormat::kFloat32}};
  const plan::CostModel fast32{
      "fast32",
      {{LayerFormat::kFloat32, 2.0}, {LayerFormat::kBFloat16, 1.0}, {LayerFormat::kNvfp4, 4.0}},
      ""};
  const auto fallback = plan::prove_plan(
      *fx.model, problem_of(fx.data), planted,
      plan::PlanOptions(budget).cost_model(fast32).floors(wide), measure_options(), 1);
  EXPECT_EQ(fallback.planned_budget, 0);
  EXPECT_EQ(fallback.rounds, 2);
  ASSERT_EQ(fallback.plan.floors.size(), 1u);
  for (size_t i = 0; i < fallback.plan.layers.size(); ++i) {
    EXPECT_EQ(fallback.plan.layers[i].format,
              i == kept ? LayerFormat::kFloat32 : LayerFormat::kBFloat16)
        << fallback.plan.layers[i].module;
  }
  // The honest measurement: a plan the rounds made (not the fallback)
  // holds the budget with the floor kept.
  const auto proven = plan::prove_plan(*fx.model, problem_of(fx.data), fx.m,
                                       plan::PlanOptions(kBudget).floors(floors), measure_options());
  EXPECT_GT(proven.planned_budget, 0);
  EXPECT_LE(proven.check.loss_change, kBudget);
  ASSERT_EQ(proven.plan.floors.size(), 1u);
  EXPECT_EQ(plan::element_bits(proven.plan.layers[l].format), 8) << name;
}

// ampx-train's default automatic plan: floors over its first and last
// blocks and a tail of 10%. The file (version 4) keeps both: loaded back,
// the same floors in their order and the same tail (and so the same tail
// start); saved again, the same bytes.
TEST(PrecisionPlanTest, PlanWithFloorsAndATailKeepsBothInItsFile) {
  plan::Measurement m;
  for (const std::string block : {"blocks.0", "blocks.1", "blocks.2"}) {
    m.layers.push_back(layer_of(block + ".fc", 1.0 / 3,
                                {{LayerFormat::kBFloat16, 0, 0},
                                 {LayerFormat::kFp8, 1e-4, 0.01},
                                 {LayerFormat::kNvfp4, 2e-4, 0.1}}));
  }
  const std::vector<plan::Floor> ends = {{"blocks.0", LayerFormat::kFp8},
                                         {"blocks.2", LayerFormat::kFp8}};
  const auto made = plan::make_plan(m, plan::PlanOptions(kBudget).floors(ends).tail(0.1));
  ASSERT_EQ(made.layers.size(), 3u);
  EXPECT_EQ(made.layers[0].format, LayerFormat::kFp8);
  EXPECT_EQ(made.layers[1].format, LayerFormat::kNvfp4);
  EXPECT_EQ(made.layers[2].format, LayerFormat::kFp8);

  TempFolder tmp;
  const auto path = (tmp.path / "ends.json").string();
  plan::save_plan(made, path);
  const std::string text = read_text(path);
  EXPECT_THAT(text, HasSubstr("{\n  \"version\": 4,\n"));
  EXPECT_THAT(text, HasSubstr("\n  \"tail\": 0.10000000000000001,\n  \"floors\": [\n"
                              "    {\"prefix\": \"blocks.0\", \"format\": \"fp8\"},\n"
                              "    {\"prefix\": \"blocks.2\", \"format\": \"fp8\"}\n  ],\n"));
  const auto loaded = plan::load_plan(path);
  EXPECT_EQ(loaded.tail, 0.1);
  EXPECT_EQ(plan::tail_start(loaded, 200), 180);
  ASSERT_EQ(loaded.floors.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(loaded.floors[i].prefix, ends[i].prefix);
    EXPECT_EQ(loaded.floors[i].format, ends[i].format);
  }
  ASSERT_EQ(loaded.layers.size(), 3u);
  for (size_t l = 0; l < 3; ++l) {
    EXPECT_EQ(loaded.layers[l].module, made.layers[l].module);
    EXPECT_EQ(loaded.layers[l].format, made.layers[l].format);
  }
  plan::save_plan(loaded, (tmp.path / "again.json").string());
  EXPECT_EQ(read_text(tmp.path / "again.json"), text);
}

// prove_plan's first round plans for the user's own options: an error
// there (a floor that names no Linear, a budget that no plan fits) reaches
// the caller as make_plan words it, not as a plan of nothing or the
// reference's fallback.
TEST(PrecisionPlanTest, ProvePlanPassesItsFirstRoundsErrorToTheCaller) {
  Measured& fx = measured_mlp();
  const auto error_of = [&](const plan::Measurement& m, const plan::PlanOptions& options) {
    return test::error_text([&] {
      (void)plan::prove_plan(*fx.model, problem_of(fx.data), m, options, measure_options());
    });
  };
  EXPECT_THAT(error_of(fx.m, plan::PlanOptions(kBudget).floors({{"fc", LayerFormat::kFp8}})),
              HasSubstr("ampx::plan::make_plan: the floor 'fc' (fp8) names no measured Linear "
                        "(fc1, fc2, fc3, head)"));
  // fc2 floored at fp32, its fp32 loss change (planted) twice the budget.
  plan::Measurement heavy = fx.m;
  for (auto& f : heavy.layers[1].formats) {
    if (f.format == LayerFormat::kFloat32) f.loss_change = 2 * kBudget;
  }
  EXPECT_THAT(error_of(heavy, plan::PlanOptions(kBudget).floors({{"fc2", LayerFormat::kFloat32}})),
              HasSubstr("ampx::plan: no assignment fits the loss budget 0.003"));
}

}  // namespace
}  // namespace ampx
