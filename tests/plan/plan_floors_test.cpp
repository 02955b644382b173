// A precision plan's floors (ampx/precision_plan.h): layers kept at or above
// their width, and a plan with floors and a tail keeping both in its file.

#include "ampx/precision_plan.h"

#include "../test_util.h"
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
using plan_test::kBudget;
using plan_test::layer_of;
using plan_test::measure_options;
using plan_test::measured;
using plan_test::Measured;
using plan_test::measured_mlp;
using plan_test::problem_of;
using plan_test::read_text;
using plan_test::TempFolder;
using plan_test::write_text;
using ::testing::HasSubstr;

/// The file of `floored` (whose floor `name` keeps layer l at fp8): version 4
/// with the floors, saved again byte for byte; an older version (`free`) has
/// none; a layer below its floor is refused.
void expect_floors_in_file(const plan::PrecisionPlan& free, const plan::PrecisionPlan& floored,
                           size_t l, const std::string& name) {
  TempFolder tmp;
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
}

/// A prefix is a module path: "fc" holds none of fc1, fc2, fc3; a floor no
/// format of the cost model reaches is refused.
void expect_floor_errors(const Measured& fx) {
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
}

/// prove_plan: a planted mismeasurement (the layer most sensitive to NVFP4
/// reported insensitive) with one round: the proof leaves the budget, and
/// the fallback keeps the floored layer in fp32, the rest in bf16, the
/// reference, even where the target runs fp32 faster (a CPU's timed model).
void expect_fallback_keeps_the_floor(Measured& fx) {
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
}

// A floor keeps the Linears under its prefix at or above its format's width
// (the published NVFP4 recipe's first and last blocks, by position): the
// floored layer leaves NVFP4 for an 8-bit format, and says why; the other
// layers are planned as before; two floors over a layer, the wider binds;
// the plan file keeps the floors (version 4) and refuses a layer below one;
// prove_plan keeps them through its rounds and its fallback.
TEST(PrecisionPlanTest, FloorsKeepTheirLayersAtOrAboveTheirWidth) {
  Measured& fx = measured_mlp();
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
  EXPECT_THAT(floored.layers[l].reason, HasSubstr("the floor '" + name +
                                                  "' keeps it at 8-bit elements or wider (fp8), "
                                                  "ruling out nvfp4"));
  EXPECT_GT(floored.cost, free.cost);  // the floor costs time: FP8's half of NVFP4's speed
  EXPECT_LE(floored.predicted_loss_change, kBudget);
  // Two floors over one layer: the wider binds.
  const std::vector<plan::Floor> two = {{name, LayerFormat::kFp8}, {name, LayerFormat::kBFloat16}};
  const auto both = plan::make_plan(fx.m, plan::PlanOptions(kBudget).floors(two));
  EXPECT_GE(plan::element_bits(both.layers[l].format), 16) << name;
  EXPECT_THAT(both.layers[l].reason, HasSubstr("the floor '" + name + "' keeps it at 16-bit"));

  ASSERT_NO_FATAL_FAILURE(expect_floors_in_file(free, floored, l, name));
  expect_floor_errors(fx);
  ASSERT_NO_FATAL_FAILURE(expect_fallback_keeps_the_floor(fx));

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

}  // namespace
}  // namespace ampx
