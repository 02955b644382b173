// --precision auto and --precision-plan (issue 44): ampx-train measures the
// workload's Linears, plans within --loss-budget for --target, applies the
// plan (each Linear converted to its format, the rest kept in bf16) and
// trains; a saved plan is applied as it is; bad flags name themselves; a
// resume keeps the plan, its tail and its floors. The plan watch (--plan-watch,
// --plan-widen, over ranks and resumes): plan_mode_watch_test.cpp.

#include "cli/config.h"
#include "distributed/rank_agreement.h"
#include "plan_mode_fixture.h"
#include "precision/auto_precision.h"
#include "run/checkpoint.h"
#include "run/trainer.h"
#include "run/workloads.h"
#include "test_support.h"

#include <ampx/fp8/convert.h>
#include <ampx/precision_plan.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <regex>
#include <string>
#include <vector>

namespace {

using namespace ampx::train;
using namespace ampx::train::test;
using namespace plan_mode_test;

TEST(PlanModeTest, AutoMeasuresPlansAndTrainsEachLinearInItsFormat) {
  TempDir tmp("ampx-plan-mode");
  write_text_data(tmp.path() / "data", "abcdefgh ", 20000, 3);
  TrainConfig config = resolved_config(plan_gpt(tmp, {{"--precision", "auto"}}));
  auto workload = make_workload(config);
  config.precision_plan = plan_precision(config, *workload);
  EXPECT_EQ(config.precision_plan, (tmp.path() / "out" / "precision-plan.json").string());
  const auto plan = ampx::plan::load_plan(config.precision_plan);
  EXPECT_EQ(plan.target, "b200");
  EXPECT_DOUBLE_EQ(plan.loss_budget, 0.005);
  EXPECT_LE(plan.predicted_loss_change, 0.005);
  EXPECT_LT(plan.cost, plan.bf16_cost);
  EXPECT_EQ(plan.tail, 0.1);  // --plan-tail's default

  ModeSetUp setup =
      set_up_mode(config, *workload, parse_mode("auto", config), torch::Device(torch::kCPU));
  EXPECT_TRUE(setup.fp8);
  std::vector<std::string> planned_fp8, planned_bf16;
  for (const auto& l : plan.layers) {
    (l.format == ampx::plan::LayerFormat::kBFloat16 ? planned_bf16 : planned_fp8)
        .push_back(l.module);
  }
  ASSERT_FALSE(planned_fp8.empty());
  std::sort(planned_fp8.begin(), planned_fp8.end());
  auto converted = setup.fp8_layers;
  std::sort(converted.begin(), converted.end());
  EXPECT_EQ(converted, planned_fp8);
  EXPECT_EQ(setup.bf16_layers.size(), planned_bf16.size());
  EXPECT_NE(std::find(setup.bf16_layers.begin(), setup.bf16_layers.end(), "head"),
            setup.bf16_layers.end());
  const auto modules = setup.model->named_modules();
  for (const auto& l : plan.layers) {
    const auto scaling = ampx::fp8::scaling_of(*modules[l.module]);
    if (l.format == ampx::plan::LayerFormat::kBFloat16) {
      EXPECT_EQ(scaling, nullptr) << l.module;
    } else {
      ASSERT_NE(scaling, nullptr) << l.module;
      EXPECT_EQ(scaling->recipe.to_string(), l.scale_rule) << l.module;
    }
  }
  const StepOutcome step = train_step(setup, *workload, workload->batch(0, torch::kCPU));
  EXPECT_TRUE(step.stepped && std::isfinite(step.loss.item<double>()));
}

// --plan-reference fp32: the budget is against every Linear in float32, so
// bf16 is one more format a layer may take (the head, whose 9 outputs FP8
// cannot take, too); the plan's fp32 and fp16 layers are caught by the FP8
// region without FP8 state, and train.
TEST(PlanModeTest, Fp32ReferencePlansAgainstFloat32) {
  TempDir tmp("ampx-plan-fp32");
  write_text_data(tmp.path() / "data", "abcdefgh ", 20000, 3);
  TrainConfig config = resolved_config(plan_gpt(
      tmp, {{"--precision", "auto"}, {"--plan-reference", "fp32"}, {"--target", "h100"}}));
  auto workload = make_workload(config);
  config.precision_plan = plan_precision(config, *workload);
  const auto plan = ampx::plan::load_plan(config.precision_plan);
  using ampx::plan::LayerFormat;
  EXPECT_EQ(plan.reference, LayerFormat::kFloat32);
  const auto h100 = ampx::plan::cost_model_for("h100");
  for (const auto& l : plan.layers) {
    EXPECT_TRUE(h100.throughput.count(l.format)) << l.module << ": " << to_string(l.format);
    if (l.module == "head") {
      EXPECT_TRUE(l.format == LayerFormat::kFloat32 || l.format == LayerFormat::kFloat16 ||
                  l.format == LayerFormat::kBFloat16)
          << to_string(l.format);
    }
  }
  // Whatever this plan chose, one layer in each wide format (the head, which
  // FP8 cannot take, in fp16), so that the run below trains both.
  auto forced = plan;
  for (auto& l : forced.layers) {
    if (l.module == "head") l.format = LayerFormat::kFloat16;
    if (l.module == "blocks.0.fc") l.format = LayerFormat::kFloat32;
  }
  const auto count = [&](LayerFormat f) {
    return std::count_if(forced.layers.begin(), forced.layers.end(),
                         [f](const auto& l) { return l.format == f; });
  };
  ASSERT_EQ(count(LayerFormat::kFloat16), 1);
  ASSERT_GE(count(LayerFormat::kFloat32), 1);
  ampx::plan::save_plan(forced, config.precision_plan);
  ModeSetUp setup =
      set_up_mode(config, *workload, parse_mode("auto", config), torch::Device(torch::kCPU));
  const auto modules = setup.model->named_modules();
  for (const auto& l : forced.layers) {
    const bool listed = std::find(setup.fp8_layers.begin(), setup.fp8_layers.end(), l.module) !=
                        setup.fp8_layers.end();
    EXPECT_EQ(listed, l.format != LayerFormat::kBFloat16) << l.module;
    const bool wide = l.format == LayerFormat::kFloat32 || l.format == LayerFormat::kFloat16;
    EXPECT_EQ(ampx::fp8::scaling_of(*modules[l.module]) != nullptr, listed && !wide) << l.module;
  }
  const StepOutcome step = train_step(setup, *workload, workload->batch(0, torch::kCPU));
  EXPECT_TRUE(step.stepped && std::isfinite(step.loss.item<double>()));
  // CLI11 refuses another reference: an exit code, no config.
  const auto bad = plan_gpt(tmp, {{"--precision", "auto"}, {"--plan-reference", "fp8"}});
  std::vector<const char*> argv{"ampx-train"};
  for (const auto& a : bad) argv.push_back(a.c_str());
  TrainConfig refused;
  const auto code = parse_command_line(static_cast<int>(argv.size()), argv.data(), refused);
  ASSERT_TRUE(code.has_value());
  EXPECT_NE(*code, 0);
}

// The binary: --precision auto prints the per-layer table and writes the
// plan; --compare O2,auto --precision-plan trains the saved plan beside O2.
TEST(PlanModeTest, BinaryPlansThenComparesTheSavedPlanWithO2) {
  TempDir tmp("ampx-plan-binary");
  write_text_data(tmp.path() / "data", "abcdefgh ", 20000, 3);
  const auto first = run_train(plan_gpt(tmp, {{"--precision", "auto"}, {"--target", "h100"}}),
                               tmp.path() / "auto.log");
  ASSERT_EQ(first.status, 0) << first.output;
  EXPECT_TRUE(contains(first.output,
                       {"blocks.0.attn.qkv", "loss change: predicted", "proof run: loss change",
                        "modelled product time on h100", "precision-plan.json"}));
  const auto plan_file = tmp.path() / "saved-plan.json";
  fs::copy_file(tmp.path() / "out" / "precision-plan.json", plan_file);
  const auto second =
      run_train(plan_gpt(tmp, {{"--compare", "O2,auto"}, {"--precision-plan", plan_file.string()}}),
                tmp.path() / "compare.log");
  ASSERT_EQ(second.status, 0) << second.output;
  EXPECT_TRUE(contains(second.output, {plan_file.string(), "auto"}));
  EXPECT_FALSE(contains(second.output, {"measuring each Linear"}));
}

TEST(PlanModeTest, BadFlagsAndPlansNameTheFlagAndTheValue) {
  TempDir tmp("ampx-plan-errors");
  write_text_data(tmp.path() / "data", "abcdefgh ", 20000, 3);
  const auto config_error = [&](std::vector<std::pair<std::string, std::string>> flags) {
    return config_error_of(tmp, flags);
  };
  EXPECT_TRUE(contains(config_error({{"--precision", "auto"}, {"--loss-budget", "0"}}),
                       {"--loss-budget '0' is not a loss change > 0"}));
  EXPECT_TRUE(contains(config_error({{"--precision", "auto"}, {"--loss-budget", "-1%"}}),
                       {"--loss-budget '-1%' is not a loss change > 0"}));
  EXPECT_TRUE(contains(config_error({{"--precision", "auto"}, {"--loss-budget", "half"}}),
                       {"--loss-budget 'half'"}));
  EXPECT_TRUE(contains(config_error({{"--precision", "O2"}, {"--plan-noise-ratio", "3"}}),
                       {"--plan-noise-ratio 3 sets the plan watch's threshold; the watch is off"}));
  EXPECT_TRUE(contains(config_error({{"--precision", "O2"}, {"--plan-reference", "fp32"}}),
                       {"--plan-reference fp32 is for --precision auto"}));
  EXPECT_TRUE(contains(config_error({{"--precision", "O2"}, {"--plan-tail", "20%"}}),
                       {"--plan-tail 20% is for --precision auto"}));
  EXPECT_TRUE(contains(config_error({{"--precision", "auto"}, {"--plan-tail", "100%"}}),
                       {"--plan-tail '100%' is not a share of the steps in [0, 1)"}));
  EXPECT_TRUE(contains(config_error({{"--precision", "O2"}, {"--precision-plan", "p.json"}}),
                       {"--precision-plan 'p.json' is for --precision auto"}));
  const auto missing = (tmp.path() / "none.json").string();
  EXPECT_TRUE(contains(config_error({{"--precision", "auto"}, {"--precision-plan", missing}}),
                       {"--precision-plan '" + missing + "': no such file"}));
  // A plan naming a module the model lacks: set_up_mode names it.
  ampx::plan::PrecisionPlan plan;
  plan.target = "b200";
  plan.loss_budget = 0.005;
  plan.layers.push_back({"blocks.9.fc", ampx::plan::LayerFormat::kNvfp4, "", 0, 0, 0, "planted"});
  const auto file = (tmp.path() / "bad-plan.json").string();
  ampx::plan::save_plan(plan, file);
  TrainConfig config =
      resolved_config(plan_gpt(tmp, {{"--precision", "auto"}, {"--precision-plan", file}}));
  auto workload = make_workload(config);
  EXPECT_TRUE(expect_error_contains(
      [&] { (void)set_up_mode(config, *workload, parse_mode("auto", config), torch::kCPU); },
      {"module 'blocks.9.fc' is not a Linear of the model"}));
}

// --resume with --precision auto and no --precision-plan trains with the
// plan the checkpoint trained with (it keeps the plan file's text), measures
// nothing, and ends as the uninterrupted run under that plan ends, even when
// the out-dir's precision-plan.json was replaced meanwhile; another plan
// given by --precision-plan is refused, by name; and a fresh run refused
// over the checkpoint measures nothing and leaves the plan file as it was.
TEST(PlanModeTest, ResumeTrainsWithTheCheckpointsPlanWithoutMeasuringAgain) {
  TempDir tmp("ampx-plan-resume-auto");
  write_text_data(tmp.path() / "data", "abcdefgh ", 20000, 3);
  ampx::train::test::EnvGuard products("AMPX_CPU_PRODUCTS", "native");  // one path in every run
  const auto parts = tmp.path() / "parts";
  const auto flags = [&](const fs::path& out, int64_t steps,
                         std::vector<std::pair<std::string, std::string>> more) {
    more.insert(more.begin(), {{"--precision", "auto"},
                               {"--steps", std::to_string(steps)},
                               {"--out-dir", out.string()},
                               {"--checkpoint-dir", (out / "ckpt").string()}});
    return plan_gpt(tmp, more);
  };
  const auto first = run_train(flags(parts, 2, {{"--save-every", "2"}}), tmp.path() / "1.log");
  ASSERT_EQ(first.status, 0) << first.output;
  ASSERT_TRUE(contains(first.output, {"measuring each Linear"})) << first.output;
  const auto measured = (tmp.path() / "measured.json").string();
  fs::copy_file(parts / "precision-plan.json", measured);
  const auto whole = run_train(
      flags(tmp.path() / "whole", 4, {{"--precision-plan", measured}, {"--save-every", "4"}}),
      tmp.path() / "whole.log");
  ASSERT_EQ(whole.status, 0) << whole.output;

  // A fresh run over the checkpoint is refused before it measures.
  fs::copy_file(nvfp4_fc_plan(tmp), parts / "precision-plan.json",
                fs::copy_options::overwrite_existing);
  const auto refused = run_train(flags(parts, 4, {{"--save-every", "2"}}), tmp.path() / "2.log");
  EXPECT_NE(refused.status, 0);
  EXPECT_TRUE(contains(refused.output, {"already holds a checkpoint"})) << refused.output;
  EXPECT_FALSE(contains(refused.output, {"measuring each Linear"})) << refused.output;
  EXPECT_EQ(read_bytes(parts / "precision-plan.json"), read_bytes(tmp.path() / "plan.json"));

  // Resumed: the checkpoint's plan, not the out-dir's file, and no measurement.
  auto resume_args = flags(parts, 4, {{"--save-every", "2"}});
  resume_args.push_back("--resume");
  const auto resumed = run_train(resume_args, tmp.path() / "3.log");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_FALSE(contains(resumed.output, {"measuring each Linear"})) << resumed.output;
  EXPECT_TRUE(contains(resumed.output, {"trained with"})) << resumed.output;
  EXPECT_EQ(read_bytes(parts / "ckpt" / "precision-plan.json"), read_bytes(measured));
  const auto losses = [](const fs::path& out) {  // bit for bit: JSON doubles round-trip
    return read_checkpoint(out / "ckpt" / "checkpoint.ampx").meta.at("losses");
  };
  EXPECT_EQ(losses(parts).size(), 4u);
  EXPECT_EQ(losses(parts), losses(tmp.path() / "whole"));

  // Another plan, named by --precision-plan: refused, naming the plan.
  auto other = flags(parts, 6, {{"--precision-plan", (tmp.path() / "plan.json").string()}});
  other.push_back("--resume");
  const auto mismatch = run_train(other, tmp.path() / "4.log");
  EXPECT_NE(mismatch.status, 0);
  EXPECT_TRUE(contains(mismatch.output, {"was written by a run with plan=", "blocks.0.fc"}))
      << mismatch.output;
}

// The plan's tail (--plan-tail, kept in the plan file): its last steps
// train with every Linear in bf16, from the step the plan places it at
// (tail 0.4: step 2 of 4, and of 3), and a run resumed past that step
// enters it again: it ends with the uninterrupted run's weights.
TEST(PlanModeTest, TailTrainsTheLastStepsInBf16AndAResumeEntersItAgain) {
  TempDir tmp("ampx-plan-tail");
  write_text_data(tmp.path() / "data", "abcdefgh ", 20000, 3);
  const auto run = [&](const std::string& name, const std::string& plan, int64_t steps,
                       bool resume) {
    // The watch checks every step and, its threshold planted, reports each check.
    auto args = plan_gpt(tmp, {{"--precision", "auto"},
                               {"--precision-plan", plan},
                               {"--steps", std::to_string(steps)},
                               {"--plan-watch", "1"},
                               {"--plan-noise-ratio", "1e9"},
                               {"--save-every", "3"},
                               {"--checkpoint-dir", (tmp.path() / name / "ckpt").string()},
                               {"--out-dir", (tmp.path() / name).string()}});
    if (resume) args.push_back("--resume");
    TrainConfig config = resolved_config(args);
    auto workload = make_workload(config);
    return train_mode(config, *workload, "auto");
  };
  const auto tailed = nvfp4_fc_plan(tmp, 0.4);
  const RunResult whole = run("whole", tailed, 4, false);
  EXPECT_EQ(whole.tail_start, 2);
  const RunResult none = run("none", nvfp4_fc_plan(tmp), 4, false);
  EXPECT_EQ(none.tail_start, -1);
  ASSERT_EQ(whole.losses.size(), 4u);
  ASSERT_EQ(none.losses.size(), 4u);
  EXPECT_EQ(whole.losses[1], none.losses[1]);  // NVFP4 before the tail
  EXPECT_NE(whole.losses[2], none.losses[2]);  // the same weights, in bf16
  EXPECT_NE(whole.weights_checksum, none.weights_checksum);
  // The watch reports steps 0-3 without the tail, 0-1 with it: in the tail its layers are bf16,
  // as its reference (ampx-train skips the check there, unseen from here).
  const auto steps_reported = [](const RunResult& r) {
    std::vector<std::string> steps;
    for (const auto& line : r.plan_watch) steps.push_back(line.substr(0, line.find(':')));
    return steps;
  };
  EXPECT_EQ(steps_reported(none),
            (std::vector<std::string>{"step 0", "step 1", "step 2", "step 3"}));
  EXPECT_EQ(steps_reported(whole), (std::vector<std::string>{"step 0", "step 1"}));

  const RunResult first = run("parts", tailed, 3, false);  // steps 0-2, checkpoint after 2
  EXPECT_EQ(first.tail_start, 2);
  const RunResult resumed = run("parts", tailed, 4, true);  // step 3, in the tail again
  EXPECT_EQ(resumed.weights_checksum, whole.weights_checksum);
  // Another tail is another plan: refused by name.
  const auto other = (tmp.path() / "other-tail.json").string();
  auto plan = ampx::plan::load_plan(tailed);
  plan.tail = 0.2;
  ampx::plan::save_plan(plan, other);
  EXPECT_TRUE(expect_error_contains([&] { (void)run("parts", other, 4, true); },
                                    {"plan_tail=0.4, this run has plan_tail=0.2"}));
  // A saved plan trains with its own tail: --plan-tail may repeat it, not change it.
  const auto set_up = [&](const std::string& tail) {
    const TrainConfig c = resolved_config(plan_gpt(
        tmp, {{"--precision", "auto"}, {"--precision-plan", tailed}, {"--plan-tail", tail}}));
    auto workload = make_workload(c);
    (void)set_up_mode(c, *workload, parse_mode("auto", c), torch::Device(torch::kCPU));
  };
  EXPECT_NO_THROW(set_up("40%"));
  EXPECT_TRUE(expect_error_contains([&] { set_up("20%"); },
                                    {"--plan-tail 20%, but the plan '", "has a tail of 0.4"}));
}

// --plan-ends (default fp8) floors the first and last blocks by position:
// with a budget every Linear fits in NVFP4, the ends' Linears take an 8-bit
// format (and their reasons say why) while the middle block takes NVFP4;
// --plan-ends none leaves them NVFP4 too. The plan file keeps the floors;
// a saved plan takes --plan-ends only as it was solved.
TEST(PlanModeTest, PlanEndsKeepTheFirstAndLastBlocksOutOfNvfp4) {
  TempDir tmp("ampx-plan-ends");
  write_text_data(tmp.path() / "data", "abcdefgh ", 20000, 3);
  const auto measure = [&](const std::string& name, const std::string& ends) {
    std::vector<std::pair<std::string, std::string>> flags = {
        {"--precision", "auto"},
        {"--layers", "3"},
        {"--loss-budget", "50%"},
        {"--plan-tail", "0"},
        {"--out-dir", (tmp.path() / name).string()}};
    if (!ends.empty()) flags.push_back({"--plan-ends", ends});
    TrainConfig config = resolved_config(plan_gpt(tmp, flags));
    auto workload = make_workload(config);
    return ampx::plan::load_plan(plan_precision(config, *workload));
  };
  const auto bits = [](const ampx::plan::LayerPlan& l) {
    return ampx::plan::element_bits(l.format);
  };
  const auto floored = measure("floored", "");  // the default
  ASSERT_EQ(floored.floors.size(), 2u);
  EXPECT_EQ(floored.floors[0].prefix, "blocks.0");
  EXPECT_EQ(floored.floors[1].prefix, "blocks.2");
  EXPECT_EQ(floored.floors[1].format, ampx::plan::LayerFormat::kFp8);
  const auto none = measure("none", "none");
  EXPECT_TRUE(none.floors.empty());
  ASSERT_EQ(none.layers.size(), floored.layers.size());
  size_t ends = 0, middle = 0;
  for (size_t i = 0; i < floored.layers.size(); ++i) {
    const auto& l = floored.layers[i];
    if (l.module == "head") continue;  // 9 outputs: bf16 only
    EXPECT_EQ(none.layers[i].format, ampx::plan::LayerFormat::kNvfp4) << l.module;
    if (l.module.rfind("blocks.1.", 0) == 0) {
      EXPECT_EQ(l.format, ampx::plan::LayerFormat::kNvfp4) << l.module;
      ++middle;
    } else {
      EXPECT_EQ(bits(l), 8) << l.module;
      EXPECT_TRUE(contains(l.reason, {"the floor 'blocks.", "' keeps it at 8-bit elements or "
                                      "wider (fp8), ruling out nvfp4"}))
          << l.reason;
      ++ends;
    }
  }
  EXPECT_EQ(ends, 2 * middle);
  EXPECT_GT(middle, 0u);
  EXPECT_GT(floored.cost, none.cost);

  // A saved plan: --plan-ends may repeat its floors, not change them.
  const auto plan_file = (tmp.path() / "floored" / "precision-plan.json").string();
  const auto set_up = [&](const std::string& ends) {
    const TrainConfig c = resolved_config(plan_gpt(tmp, {{"--precision", "auto"},
                                                         {"--layers", "3"},
                                                         {"--precision-plan", plan_file},
                                                         {"--plan-ends", ends}}));
    auto workload = make_workload(c);
    (void)set_up_mode(c, *workload, parse_mode("auto", c), torch::Device(torch::kCPU));
  };
  EXPECT_NO_THROW(set_up("fp8"));
  EXPECT_TRUE(expect_error_contains(
      [&] { set_up("none"); },
      {"--plan-ends none (floors: none), but the plan '" + plan_file,
       "was solved with floors: blocks.0, blocks.2 at 8-bit elements or wider (fp8)"}));
  EXPECT_TRUE(contains(config_error_of(tmp, {{"--precision", "O2"}, {"--plan-ends", "bf16"}}),
                       {"--plan-ends bf16 is for --precision auto"}));
}

}  // namespace
