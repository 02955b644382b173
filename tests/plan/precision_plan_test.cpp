// Automatic per-layer precision (ampx/precision_plan.h): the solver against
// brute force, and measurement, plan, apply and proof on a real training run
// of a small MLP classifying a random teacher network's labels (its plan
// files: plan_file_test.cpp; floors: plan_floors_test.cpp).

#include "ampx/precision_plan.h"

#include "../test_util.h"
#include "ampx/detail/plan_solver.h"
#include "ampx/fp8/convert.h"
#include "plan_fixture.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace ampx {
namespace {

using plan::LayerFormat;
using plan_test::has_format;
using plan_test::kBudget;
using plan_test::layer_of;
using plan_test::measure_options;
using plan_test::measured;
using plan_test::Measured;
using plan_test::measured_mlp;
using plan_test::problem_of;
using plan_test::read_text;
using plan_test::TempFolder;
using plan_test::users_loop;
using plan_test::write_text;
using ::testing::HasSubstr;

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

  const auto h100 = plan::prove_plan(
      *fx.model, problem_of(fx.data), fx.m,
      plan::PlanOptions(kBudget).cost_model(plan::cost_model_for("h100")), measure_options());
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
  const auto proven =
      plan::prove_plan(*fx.model, problem_of(fx.data), m, plan::PlanOptions(budget), options);
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
