// What a resume checks and takes from an ampx-train checkpoint's description,
// on real files in a temporary folder: check_compatible (the same run
// accepted, each differing or missing setting named with both values, a
// precision plan compared where the checkpoint records it) and read_progress
// (a round trip with a NaN loss, each damaged field named). The file format
// itself: checkpoint_test.cpp.

#include "run/checkpoint.h"

#include <ampx/grad_scaler.h>
#include "checkpoint_fixture.h"
#include "test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>
#include <string>

namespace {

using ampx::train::check_compatible;
using ampx::train::read_checkpoint;
using ampx::train::read_progress;
using ampx::train::write_checkpoint;
using nlohmann::json;
using namespace ampx::train::test;

TEST_F(TrainCheckpointTest, AcceptsTheSameRun) {
  const json run = {{"workload", "gpt"}, {"precision", "O2"}, {"dtype", "bf16"}, {"lr", 0.001}};
  EXPECT_NO_THROW(check_compatible(path_, run, run));
  // Keys the run does not ask about are not compared.
  EXPECT_NO_THROW(check_compatible(path_, run, json{{"precision", "O2"}}));
}

// A precision plan's formats and target are run settings checkpoints
// record only since they keep the plan: an older auto checkpoint, without
// them, resumes; one that has them must match.
TEST_F(TrainCheckpointTest, ComparesThePlanWhereTheCheckpointRecordsIt) {
  const json older = {{"precision", "auto"}};
  json run = older;
  run["plan"] = {{"blocks.0.fc", "nvfp4"}};
  run["plan_target"] = "b200";
  EXPECT_NO_THROW(check_compatible(path_, older, run));
  EXPECT_NO_THROW(check_compatible(path_, run, run));
  json other = run;
  other["plan"]["blocks.0.fc"] = "mxfp8";
  EXPECT_TRUE(
      expect_error_contains([&] { check_compatible(path_, run, other); },
                            {"was written by a run with plan={\"blocks.0.fc\":\"nvfp4\"}"}));
  // Any other setting a checkpoint lacks is still refused.
  EXPECT_TRUE(expect_error_contains(
      [&] {
        check_compatible(path_, older, json{{"dtype", "bf16"}});
      },
      {"was written by a run with dtype=(none)"}));
  // A plan without a tail (before plans had one) resumes under a tail of 0 only.
  run["plan_tail"] = 0.0;
  EXPECT_NO_THROW(check_compatible(path_, older, run));
  EXPECT_NO_THROW(check_compatible(path_, run, run));
  json tailed = run;
  tailed["plan_tail"] = 0.1;
  EXPECT_TRUE(expect_error_contains([&] { check_compatible(path_, older, tailed); },
                                    {"was written by a run with plan_tail=0.0, this run has "
                                     "plan_tail=0.1"}));
  // So does an FP8 mode's checkpoint from before --fp8-tail.
  const json fp8 = {{"precision", "nvfp4"}};
  EXPECT_NO_THROW(check_compatible(path_, fp8, json{{"precision", "nvfp4"}, {"fp8_tail", 0.0}}));
  EXPECT_TRUE(expect_error_contains(
      [&] {
        check_compatible(path_, fp8, json{{"precision", "nvfp4"}, {"fp8_tail", 0.1}});
      },
      {"was written by a run with fp8_tail=0.0, this run has fp8_tail=0.1"}));
}

TEST_F(TrainCheckpointTest, NamesADifferentPrecisionAndBothValues) {
  const json saved = {{"workload", "gpt"}, {"precision", "O2"}, {"dtype", "bf16"}};
  json run = saved;
  run["precision"] = "O1";
  EXPECT_EQ(error_text([&] { check_compatible(path_, saved, run); }),
            where() +
                " was written by a run with precision=\"O2\", this run has precision=\"O1\"; "
                "resume it with the same settings, or pass another --checkpoint-dir");
}

TEST_F(TrainCheckpointTest, NamesADifferentNumber) {
  const json saved = {{"steps_per_epoch", 468}};
  EXPECT_TRUE(expect_error_contains(
      [&] {
        check_compatible(path_, saved, json{{"steps_per_epoch", 469}});
      },
      {where(), "steps_per_epoch=468", "this run has steps_per_epoch=469"}));
}

TEST_F(TrainCheckpointTest, NamesAKeyMissingFromTheSavedRun) {
  const json saved = {{"workload", "gpt"}};
  const json run = {{"workload", "gpt"}, {"block_size", 8}};
  EXPECT_EQ(error_text([&] { check_compatible(path_, saved, run); }),
            where() +
                " was written by a run with block_size=(none), this run has block_size=8; "
                "resume it with the same settings, or pass another --checkpoint-dir");
}

// What a resume takes from the description: a round trip through the file,
// including the NaN loss of a step that overflowed (JSON writes it as null).
TEST_F(TrainCheckpointTest, ProgressRoundTripsWithANanLoss) {
  ampx::GradScaler scaler(ampx::GradScalerOptions().init_scale(512.0).growth_interval(7));
  const json meta = {{"run", json::object()},
                     {"step", 3},
                     {"skipped", 1},
                     {"losses", {2.5, std::numeric_limits<double>::quiet_NaN(), 2.25}},
                     {"amp", {{"scaler0", ampx::train::state_dict_to_json(scaler.state_dict())}}}};
  write_checkpoint(path_, meta, "payload");
  const auto p = read_progress(path_, read_checkpoint(path_));
  EXPECT_EQ(p.state.next_step, 3);
  EXPECT_EQ(p.state.skipped, 1);
  ASSERT_EQ(p.state.losses.size(), 3u);
  EXPECT_EQ(p.state.losses[0], 2.5);
  EXPECT_TRUE(std::isnan(p.state.losses[1]));
  EXPECT_EQ(p.state.losses[2], 2.25);
  ASSERT_EQ(p.scalers.count("scaler0"), 1u);
  ampx::GradScaler loaded;
  loaded.load_state_dict(p.scalers.at("scaler0"));
  EXPECT_EQ(loaded.get_scale(), 512.0);
  EXPECT_EQ(loaded.get_growth_interval(), 7);
}

TEST_F(TrainCheckpointTest, ProgressNamesEachDamagedField) {
  const json good = {{"run", json::object()},
                     {"step", 2},
                     {"skipped", 0},
                     {"losses", {1.0, 2.0}},
                     {"amp", {{"scaler0", {{"scale", 8.0}}}}}};
  const auto error_for = [&](const char* key, const json& value) {
    json meta = good;
    if (value.is_discarded()) {
      meta.erase(key);
    } else {
      meta[key] = value;
    }
    write_checkpoint(path_, meta, "payload");
    return error_text([&] { read_progress(path_, read_checkpoint(path_)); });
  };
  const json gone = json(json::value_t::discarded);
  EXPECT_EQ(error_for("skipped", gone), where() + " has no 'skipped' in its description");
  EXPECT_EQ(error_for("step", -1), where() + " has step=-1; expected an integer >= 0");
  EXPECT_EQ(error_for("step", "2"), where() + " has step=\"2\"; expected an integer >= 0");
  EXPECT_EQ(error_for("skipped", 2.5), where() + " has skipped=2.5; expected an integer >= 0");
  EXPECT_EQ(error_for("skipped", 3), where() + " has skipped=3 steps of its 2");
  EXPECT_EQ(error_for("losses", {1.0}),
            where() + " has 1 losses for its 2 steps; expected one loss per step");
  EXPECT_EQ(error_for("losses", "x"),
            where() + " has string for its 2 steps; expected one loss per step");
  EXPECT_EQ(error_for("losses", {1.0, "x"}), where() + " has a loss of \"x\"; expected a number");
  EXPECT_EQ(error_for("amp", 5),
            where() + " has amp=number; expected the loss scalers' states as an object");
  EXPECT_EQ(error_for("amp", {{"scaler0", {1, 2}}}),
            where() + " has a loss scaler 'scaler0' of type array; expected an object");
  EXPECT_EQ(error_for("amp", {{"scaler0", {{"scale", {1}}}}}),
            where() +
                " has loss scaler 'scaler0' state 'scale' = [1]; expected a number, "
                "boolean, string or null");
  EXPECT_EQ(error_for("plan_formats", {1, 2}),
            where() + " has plan_formats=[1,2]; expected the watched plan's formats by module");
  EXPECT_EQ(error_for("plan_formats", {{"fc", 3}}),
            where() + " has plan_formats 'fc' = 3; expected a layer format's name");
  EXPECT_EQ(error_for("plan_formats", {{"fc", "fp5"}}),
            where() + " has plan_formats 'fc' = 'fp5', not a layer format");
  EXPECT_EQ(error_for("plan_formats", {{"fc", "mxfp8"}}), "");
  EXPECT_EQ(read_progress(path_, read_checkpoint(path_)).state.plan_formats.at("fc"), "mxfp8");
  EXPECT_EQ(error_for("step", 2), "");  // the good description itself
}

}  // namespace
