// A precision plan's file (ampx/precision_plan.h): saved and loaded back to
// the same plan and bytes, applied as the original; bad input refused
// naming the argument and the value; the tail kept in it; its JSON read by
// nlohmann-json, with the byte of an error and the reader's limits.

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
using plan_test::has_format;
using plan_test::kBudget;
using plan_test::measure_options;
using plan_test::Measured;
using plan_test::measured_mlp;
using plan_test::Mlp;
using plan_test::problem_of;
using plan_test::read_text;
using plan_test::TempFolder;
using plan_test::train_planned;
using plan_test::write_text;
using ::testing::HasSubstr;
using ::testing::Not;

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
  EXPECT_DOUBLE_EQ(
      plan::run_cost(against_fp32, b200),
      0.9 * plan.cost + 0.1 * plan.bf16_cost / b200.throughput.at(LayerFormat::kFloat32));

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
  EXPECT_THAT(
      test::error_text([&] { (void)plan::make_plan(fx.m, plan::PlanOptions(kBudget).tail(1)); }),
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

// The JSON itself (nlohmann-json): what is not JSON is refused naming the
// byte where it went wrong, and the limits the plan's reader adds hold: each
// key once in an object, at most 32 nested arrays and objects.
std::string error_of(const std::string& text) {
  return test::error_text([&] { (void)plan::parse_plan(text, "mine"); });
}

TEST(PlanJsonTest, NotJsonIsRefusedNamingTheByteAndTheLimitsHold) {
  EXPECT_THAT(error_of(R"({"a": x})"), HasSubstr("'mine': not valid JSON at byte 6: "));
  EXPECT_THAT(error_of(R"({"a": 1})" + std::string(" ]")),
              HasSubstr("'mine': not valid JSON at byte 9: "));
  EXPECT_THAT(
      error_of(R"({"a": 1})" + std::string(1, '\0') + "]"),
      HasSubstr("'mine': not valid JSON at byte 8: a NUL byte, which JSON text never holds"));
  EXPECT_THAT(error_of(R"({"a": 1, "a": 2})"),
              HasSubstr("'mine': not valid JSON here: the key 'a' twice in one object"));
  // The same key in two objects is two keys.
  EXPECT_THAT(error_of(R"({"a": {"a": 1}, "b": {"a": 2}})"), Not(HasSubstr("not valid JSON")));
  EXPECT_THAT(error_of(std::string(33, '[') + std::string(33, ']')),
              HasSubstr("'mine': not valid JSON here: more than 32 nested arrays and objects"));
  // 32 deep is JSON: refused as a plan, not as JSON.
  EXPECT_THAT(error_of(std::string(32, '[') + std::string(32, ']')),
              Not(HasSubstr("not valid JSON")));
  EXPECT_THAT(error_of("1e999"), HasSubstr("'mine': not valid JSON"));
}

}  // namespace
}  // namespace ampx
