// The plan watch of --precision auto (--plan-watch, --plan-widen): watched
// steps train as unwatched ones; over --nproc ranks and ranks an outside
// launcher started, the plan is measured once and the ranks watch the
// averaged gradients and move the same layers; a resumed run moves the
// layers where the watch left them. Planning and applying plans:
// plan_mode_test.cpp.

#include "cli/config.h"
#include "distributed/rank_agreement.h"
#include "plan_mode_fixture.h"
#include "run/checkpoint.h"
#include "run/trainer.h"
#include "run/workloads.h"
#include "test_support.h"

#include <ampx/dist.h>
#include <ampx/precision_plan.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace ampx::train;
using namespace ampx::train::test;
using namespace plan_mode_test;

// --plan-watch: a watched step runs the batch twice (the second with every
// Linear in bf16) and trains exactly as an unwatched one; the settings
// table says so; the flags that cannot go together name themselves.
TEST(PlanModeTest, WatchedStepsTrainAsUnwatchedOnesAndBadWatchFlagsNameThemselves) {
  TempDir tmp("ampx-plan-watch");
  write_text_data(tmp.path() / "data", "abcdefgh ", 20000, 3);
  const auto file = nvfp4_fc_plan(tmp);
  const auto trained = [&](const std::string& every) {
    TrainConfig config = resolved_config(plan_gpt(
        tmp, {{"--precision", "auto"}, {"--precision-plan", file}, {"--plan-watch", every}}));
    auto workload = make_workload(config);
    ModeSetUp setup = set_up_mode(config, *workload, parse_mode("auto", config), torch::kCPU);
    EXPECT_EQ(setup.watch != nullptr, every != "0");
    for (int64_t step = 0; step < 3; ++step) {
      const StepOutcome out = train_step(setup, *workload, workload->batch(step, torch::kCPU));
      EXPECT_EQ(out.watched, every == "1") << step;
    }
    return weights_checksum(*setup.model);
  };
  EXPECT_EQ(trained("1"), trained("0"));

  const TrainConfig defaults =
      resolved_config(plan_gpt(tmp, {{"--precision", "auto"}, {"--precision-plan", file}}));
  EXPECT_EQ(defaults.plan_watch, 50);
  EXPECT_TRUE(
      contains(settings_table(defaults), {"plan watch",
                                          "every 50 steps against bf16 (left out of the timing), "
                                          "reports"}));
  EXPECT_EQ(resolved_config(plan_gpt(tmp, {{"--precision", "O2"}})).plan_watch, 0);
  const auto config_error = [&](std::vector<std::pair<std::string, std::string>> flags,
                                bool widen = false) {
    return config_error_of(
        tmp, flags, widen ? std::vector<std::string>{"--plan-widen"} : std::vector<std::string>{});
  };
  EXPECT_TRUE(contains(config_error({{"--precision", "O2"}, {"--plan-watch", "3"}}),
                       {"--plan-watch 3 is for --precision auto"}));
  EXPECT_TRUE(contains(config_error({{"--precision", "O2"}}, true),
                       {"--plan-widen is for --precision auto"}));
  EXPECT_TRUE(contains(config_error({{"--precision", "auto"}, {"--plan-watch", "0"}}, true),
                       {"--plan-widen moves the layers the watch reports; --plan-watch is 0"}));
  // Data-parallel runs watch too (the ranks decide on rank 0's numbers).
  EXPECT_EQ(resolved_config(plan_gpt(tmp, {{"--precision", "auto"}, {"--nproc", "2"}})).plan_watch,
            50);
  // Ranks an outside launcher (torchrun) started measure on rank 0, but a
  // --compare on them has no process to measure in once for all.
  EnvGuard rank("RANK", "1"), world("WORLD_SIZE", "2");
  EXPECT_TRUE(resolved_config(plan_gpt(tmp, {{"--precision", "auto"}})).precision_plan.empty());
  EXPECT_TRUE(contains(config_error({{"--compare", "O2,auto"}}),
                       {"--compare with auto on ranks a launcher started has no process to "
                        "measure the plan in once for all"}));
  EXPECT_EQ(resolved_config(plan_gpt(tmp, {{"--precision", "auto"}, {"--precision-plan", file}}))
                .precision_plan,
            file);
}

/// The checksum of each rank's weights in a run's output ("[auto] rank 1 of
/// 2: weights 0x..."), in the order the ranks printed them.
std::vector<std::string> ranks_weights(const std::string& output) {
  static const std::regex re(R"(rank \d+ of \d+: weights (0x[0-9a-f]+))");
  std::vector<std::string> out;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), re);
       it != std::sregex_iterator(); ++it) {
    out.push_back((*it)[1].str());
  }
  return out;
}

/// How many times a run's output says it measured the model's Linears.
size_t measurings(const std::string& output) {
  size_t n = 0;
  for (size_t at = 0; (at = output.find("measuring each Linear", at)) != std::string::npos; ++at)
    ++n;
  return n;
}

/// Starts two ranks of ampx-train as an outside launcher (torchrun) would, on
/// a free loopback port: rank r named <name><r>, plan_gpt with flags_of(r)
/// and its own --out-dir, its output in <tmp>/<name><r>.log.
std::vector<std::pair<pid_t, fs::path>> launch_two_ranks(
    const TempDir& tmp, const std::string& name,
    const std::function<std::vector<std::pair<std::string, std::string>>(int)>& flags_of) {
  const std::string port = std::to_string(ampx::dist::free_loopback_port());
  std::vector<std::pair<pid_t, fs::path>> ranks;
  for (int r = 0; r < 2; ++r) {
    const std::string rank_name = name + std::to_string(r);
    auto flags = flags_of(r);
    flags.push_back({"--out-dir", (tmp.path() / rank_name).string()});
    const auto args = plan_gpt(tmp, flags);
    const auto log = tmp.path() / (rank_name + ".log");
    ranks.emplace_back(
        spawn_train(args, log,
                    {"RANK=" + std::to_string(r), "LOCAL_RANK=" + std::to_string(r), "WORLD_SIZE=2",
                     "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port}),
        log);
  }
  return ranks;
}

/// Ranks an outside launcher started without a plan: rank 0 measures it,
/// once, and both train it (equal weights: `weights`, those of --nproc 2 with
/// the plan `plan`).
void expect_launched_ranks_measure_once(const TempDir& tmp, const std::string& plan,
                                        const std::vector<std::string>& weights) {
  const auto ranks = launch_two_ranks(tmp, "measured", [](int) {
    return std::vector<std::pair<std::string, std::string>>{
        {"--precision", "auto"}, {"--plan-watch", "1"}, {"--steps", "3"}};
  });
  std::vector<std::string> outputs;
  for (const auto& [pid, log] : ranks) {
    const Exit e = wait_train(pid, log, std::chrono::seconds(120));
    EXPECT_EQ(e.status, 0) << e.output;
    outputs.push_back(e.output);
  }
  EXPECT_EQ(measurings(outputs[0]), 1u) << outputs[0];
  EXPECT_EQ(measurings(outputs[1]), 0u) << outputs[1];
  EXPECT_EQ(read_bytes(tmp.path() / "measured0" / "precision-plan.json"), read_bytes(plan));
  EXPECT_FALSE(fs::exists(tmp.path() / "measured1" / "precision-plan.json"));
  EXPECT_EQ(ranks_weights(outputs[0] + outputs[1]), weights);
}

/// Ranks an outside launcher started with different plans (`plan` on rank 0,
/// `planned` with one more layer in fp8 on rank 1) fail at start-up, each
/// naming the plans.
void expect_ranks_with_different_plans_fail(const TempDir& tmp, const std::string& plan,
                                            const ampx::plan::PrecisionPlan& planned) {
  auto other = planned;
  const auto fp8 = ampx::plan::LayerFormat::kFp8;
  for (auto& l : other.layers) {
    if (l.format == fp8) continue;
    if (l.format == ampx::plan::LayerFormat::kBFloat16) continue;
    l.format = fp8;
    l.scale_rule = ampx::plan::scale_rule_of(fp8);
    break;
  }
  const auto other_file = (tmp.path() / "other-plan.json").string();
  ampx::plan::save_plan(other, other_file);
  const auto ranks = launch_two_ranks(tmp, "launched", [&](int r) {
    return std::vector<std::pair<std::string, std::string>>{
        {"--precision", "auto"}, {"--precision-plan", r == 0 ? plan : other_file}};
  });
  for (const auto& [pid, log] : ranks) {
    const Exit e = wait_train(pid, log, std::chrono::seconds(120));
    EXPECT_NE(e.status, 0) << e.output;
    EXPECT_TRUE(
        contains(e.output, {"ranks of this run were started with different settings", "plan: {"}))
        << e.output;
  }
}

// --nproc 2 --precision auto: the plan is measured once, before the ranks
// start, and handed to both; the watch compares the gradients averaged over
// the ranks (its backward synchronizes too: without that, DDP refuses the
// next step's gradients), so a watched run trains as an unwatched one, and
// with --plan-widen both ranks move the same layers at the same steps.
TEST(PlanModeTest, NprocMeasuresOnceAndItsRanksWatchTheAveragedGradients) {
  if (!ampx::dist::is_available()) GTEST_SKIP() << "ampx built without c10d/Gloo";
  TempDir tmp("ampx-plan-nproc");
  write_text_data(tmp.path() / "data", "abcdefgh ", 20000, 3);
  const auto run = [&](const std::string& name,
                       std::vector<std::pair<std::string, std::string>> flags, bool widen = false) {
    flags.insert(flags.end(), {{"--precision", "auto"},
                               {"--nproc", "2"},
                               {"--steps", "3"},
                               {"--out-dir", (tmp.path() / name).string()}});
    auto args = plan_gpt(tmp, flags);
    if (widen) args.push_back("--plan-widen");
    return run_train(args, tmp.path() / (name + ".log"));
  };
  const auto watched = run("watched", {{"--plan-watch", "1"}});
  ASSERT_EQ(watched.status, 0) << watched.output;
  EXPECT_EQ(measurings(watched.output), 1u) << watched.output;
  const auto plan = (tmp.path() / "watched" / "precision-plan.json").string();
  const auto weights = ranks_weights(watched.output);
  ASSERT_EQ(weights.size(), 2u) << watched.output;
  EXPECT_EQ(weights[0], weights[1]);

  const auto unwatched = run("unwatched", {{"--precision-plan", plan}, {"--plan-watch", "0"}});
  ASSERT_EQ(unwatched.status, 0) << unwatched.output;
  EXPECT_EQ(measurings(unwatched.output), 0u);
  EXPECT_EQ(ranks_weights(unwatched.output), weights);

  // --plan-noise-ratio 1e9: every check reports every watched layer, which
  // moves one format wider at each of steps 0, 1 and 2.
  const auto widened =
      run("widened",
          {{"--precision-plan", plan}, {"--plan-watch", "1"}, {"--plan-noise-ratio", "1e9"}}, true);
  ASSERT_EQ(widened.status, 0) << widened.output;
  const auto widened_weights = ranks_weights(widened.output);
  ASSERT_EQ(widened_weights.size(), 2u) << widened.output;
  EXPECT_EQ(widened_weights[0], widened_weights[1]);
  EXPECT_NE(widened_weights[0], weights[0]);
  const auto planned = ampx::plan::load_plan(plan);
  const auto moved =
      ampx::plan::load_plan((tmp.path() / "widened" / "precision-plan-watched.json").string());
  ASSERT_EQ(moved.layers.size(), planned.layers.size());
  int64_t watched_layers = 0;
  for (size_t i = 0; i < planned.layers.size(); ++i) {
    auto expected = planned.layers[i].format;
    if (expected != ampx::plan::LayerFormat::kBFloat16) ++watched_layers;
    for (int step = 0; step < 3; ++step) expected = ampx::plan::wider_format(expected, "b200");
    EXPECT_EQ(moved.layers[i].format, expected) << planned.layers[i].module;
  }
  EXPECT_GT(watched_layers, 0);

  // --compare O2,auto over two ranks: measured once in the parent, which
  // hands the plan to auto's ranks; O2's ranks need none.
  const auto compared =
      run_train(plan_gpt(tmp, {{"--compare", "O2,auto"},
                               {"--nproc", "2"},
                               {"--out-dir", (tmp.path() / "compared").string()}}),
                tmp.path() / "compared.log");
  ASSERT_EQ(compared.status, 0) << compared.output;
  EXPECT_EQ(measurings(compared.output), 1u) << compared.output;
  EXPECT_EQ(ranks_weights(compared.output).size(), 4u) << compared.output;

  // Ranks an outside launcher started without a plan: rank 0 measures it,
  // once, and both train it; started with different plans, they fail.
  expect_launched_ranks_measure_once(tmp, plan, weights);
  expect_ranks_with_different_plans_fail(tmp, plan, planned);
}

// --plan-widen with checkpoints: the checkpoint keeps the formats the watch
// moved the layers to, and a resumed run moves them there again, so that it
// ends with the uninterrupted run's weights bit for bit and the same watched
// plan. (--plan-noise-ratio 1e9 makes every check report the layer: it
// widens one format a step, nvfp4 to bf16 in 4 steps.)
TEST(PlanModeTest, WidenedLayersResumeInTheFormatsTheWatchLeftThem) {
  TempDir tmp("ampx-plan-resume");
  write_text_data(tmp.path() / "data", "abcdefgh ", 20000, 3);
  const auto file = nvfp4_fc_plan(tmp);
  const auto run = [&](const std::string& name, int64_t steps, bool resume) {
    std::vector<std::pair<std::string, std::string>> flags{
        {"--precision", "auto"},
        {"--precision-plan", file},
        {"--plan-watch", "1"},
        {"--plan-noise-ratio", "1e9"},
        {"--steps", std::to_string(steps)},
        {"--save-every", "2"},
        {"--checkpoint-dir", (tmp.path() / name / "ckpt").string()},
        {"--out-dir", (tmp.path() / name).string()}};
    auto args = plan_gpt(tmp, flags);
    args.push_back("--plan-widen");
    if (resume) args.push_back("--resume");
    TrainConfig config = resolved_config(args);
    auto workload = make_workload(config);
    return train_mode(config, *workload, "auto");
  };
  const RunResult whole = run("whole", 4, false);
  ASSERT_FALSE(whole.watched_plan_path.empty());
  EXPECT_EQ(ampx::plan::load_plan(whole.watched_plan_path).layers[0].format,
            ampx::plan::LayerFormat::kBFloat16);
  (void)run("parts", 2, false);
  const auto saved = read_checkpoint((tmp.path() / "parts" / "ckpt" / "checkpoint.ampx"));
  EXPECT_EQ(saved.meta.at("plan_formats").at("blocks.0.fc"), "fp8");  // nvfp4, mxfp8, fp8
  const RunResult resumed = run("parts", 4, true);
  EXPECT_EQ(resumed.weights_checksum, whole.weights_checksum);
  ASSERT_FALSE(resumed.watched_plan_path.empty());
  EXPECT_EQ(ampx::plan::load_plan(resumed.watched_plan_path).layers[0].format,
            ampx::plan::LayerFormat::kBFloat16);

  // Resumed without the watch, the moved layers would train in the plan's
  // formats: refused, by name.
  auto args = plan_gpt(tmp, {{"--precision", "auto"},
                             {"--precision-plan", file},
                             {"--plan-watch", "0"},
                             {"--steps", "4"},
                             {"--checkpoint-dir", (tmp.path() / "parts" / "ckpt").string()},
                             {"--out-dir", (tmp.path() / "parts").string()}});
  args.push_back("--resume");
  TrainConfig config = resolved_config(args);
  auto workload = make_workload(config);
  EXPECT_TRUE(expect_error_contains([&] { (void)train_mode(config, *workload, "auto"); },
                                    {"holds layers the plan watch moved to wider formats"}));
}

}  // namespace
