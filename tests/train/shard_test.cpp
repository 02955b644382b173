// ampx-train --shard: 2 ranks of gpt and gpt-nn trained with each sharding
// (ZeRO-1, -2, -3) against the same run under DistributedDataParallel.

#include "cli/config.h"
#include "distributed/sharding.h"
#include "shard_fixture.h"
#include "test_support.h"

#include <ampx/dist.h>
#include <ampx/version.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using ampx::train::test::contains;
using ampx::train::test::TempDir;

namespace {

#ifdef AMPX_TRAIN_BINARY

using ampx::train::test::bytes_of;
using ampx::train::test::losses;
using ampx::train::test::ShardRun;
using ampx::train::test::ShardTest;

// fp32 and O1 compute with fp32 weights in every sharding, and two ranks'
// sums have one order: each sharding trains DDP's run bit for bit. Under
// ZeRO-2 and -3 rank 0 gathers the fp32 weights unit by unit for the
// checksum and --export-weights, under ZeRO-1 every rank gathers the
// masters for the export: the file DDP's run writes, byte for byte.
// Each rank's peak memory is in the result.
TEST_F(ShardTest, Fp32AndO1TrainDdpsRunBitForBitInEverySharding) {
  const auto exported = [&](const std::string& shard) {
    return tmp_.path() / ("weights-" + shard + ".safetensors");
  };
  for (const std::string workload : {"gpt", "gpt-nn"}) {
    const bool gpt = workload == "gpt";
    const std::string mode = gpt ? "fp32" : "O1";
    const auto export_flag = [&](const std::string& shard) {
      return std::vector<std::pair<std::string, std::string>>{
          {"--export-weights", gpt ? exported(shard).string() : ""}};
    };
    const ShardRun ddp = run(workload, "none", mode, export_flag("none"));
    ASSERT_EQ(ddp.weights.size(), 2u) << ddp.output;
    ASSERT_EQ(losses(ddp).size(), 20u);
    EXPECT_LT(losses(ddp).back(), losses(ddp).front());
    const auto shardings = gpt ? std::vector<std::string>{"optimizer", "grad", "full"}
                               : std::vector<std::string>{"full"};
    for (const auto& shard : shardings) {
      const ShardRun sharded =
          run(workload, shard, mode,
              shard != "grad" ? export_flag(shard) : decltype(export_flag(""))());
      EXPECT_EQ(losses(sharded), losses(ddp)) << workload << " " << shard;
      EXPECT_EQ(sharded.weights, std::vector<std::string>(2, ddp.weights[0]))
          << workload << " " << shard;
      const auto peaks = sharded.result.value("rank_peak_bytes", std::vector<int64_t>{});
      ASSERT_EQ(peaks.size(), 2u) << shard;
      EXPECT_GT(peaks[1], 0);
      EXPECT_EQ(sharded.result["peak_bytes"].get<int64_t>(), std::max(peaks[0], peaks[1]));
    }
  }
  ASSERT_FALSE(bytes_of(exported("none")).empty());
  EXPECT_EQ(bytes_of(exported("full")), bytes_of(exported("none")));
  EXPECT_EQ(bytes_of(exported("optimizer")), bytes_of(exported("none")));
}

// O2 on bf16: ZeRO-1 and the wrapper (grad, full) sum and keep the
// averaged gradients in fp32 and step fp32 shards; DDP rounds each averaged
// gradient to bf16 (the parameters' dtype) and steps masters beside bf16
// weights. The first loss is the same (one forward of the same weights),
// the later ones agree within 0.5% over 20 steps (and over 50 on 2 and 4
// ranks: `make test-shard-long`); ZeRO-2 and -3 are the same computation,
// bit for bit.
TEST_F(ShardTest, O2TrainsDdpsRunToTheRoundingOfTheAveragedGradients) {
  const auto steps = static_cast<size_t>(steps_);
  for (const std::string workload : {"gpt", "gpt-nn"}) {
    const bool gpt = workload == "gpt";
    const ShardRun ddp = run(workload, "none", "O2");
    const ShardRun full = run(workload, "full", "O2");
    ASSERT_EQ(losses(ddp).size(), steps);
    std::vector<const ShardRun*> sharded = {&full};
    ShardRun grad, zero1;
    if (gpt) {
      grad = run(workload, "grad", "O2");
      zero1 = run(workload, "optimizer", "O2");
      EXPECT_EQ(losses(full), losses(grad));
      EXPECT_EQ(full.weights, grad.weights);
      sharded.push_back(&zero1);
    }
    for (const ShardRun* r : sharded) {
      ASSERT_EQ(losses(*r).size(), steps);
      EXPECT_EQ(losses(*r)[0], losses(ddp)[0]) << workload;  // one forward, one batch
      for (size_t s = 1; s < steps; ++s) {
        EXPECT_NEAR(losses(*r)[s], losses(ddp)[s], 5e-3 * losses(ddp)[s])
            << workload << " step " << s;
      }
    }
  }
}

// --recompute under DDP and ZeRO-1: the checkpointed blocks' gradients
// arrive in the recompute's backward, inside the step's, and the gradient
// hooks reduce them as any others: the losses and each rank's weights of the
// same run without it, bit for bit (O2: the recompute re-enters its region).
TEST_F(ShardTest, RecomputeTrainsDdpsAndZeroOnesRunsBitForBit) {
  for (const std::string shard : {"none", "optimizer"}) {
    const ShardRun plain = run("gpt", shard, "O2");
    ASSERT_EQ(plain.weights.size(), 2u) << plain.output;
    const std::string recompute = shard == "none" ? "blocks" : "mlp";
    const ShardRun recomputed =
        run("gpt", shard, "O2",
            {{"--recompute", recompute},
             {"--out-dir", (tmp_.path() / ("gpt-" + shard + "-O2-" + recompute)).string()}});
    ASSERT_EQ(losses(recomputed).size(), static_cast<size_t>(steps_));
    EXPECT_EQ(losses(recomputed), losses(plain)) << shard << " " << recompute;
    EXPECT_EQ(recomputed.weights, plain.weights) << shard << " " << recompute;
  }
}

// fp16 with loss scaling, on a run that overflows on purpose (the first
// scale 2^24, doubled again after every 3 clean steps): every sharding skips
// the steps DDP skips. Each rank's backward is the same computation under
// every wrapper (16-bit weights cast from the same fp32 values, the same
// rows), so an overflow in it reaches every wrapper's found-inf, which the
// ranks agree on; and no sum adds one of its own (the wrapper and ZeRO-1
// reduce in fp32, DDP's fp16 sums are divided first). O1's gradients are
// fp32 everywhere: DDP's losses bit for bit; O2's within the rounding of the
// averaged gradients, as in bf16 above. LibTorch 2.x (fp16 on the CPU).
TEST_F(ShardTest, Fp16RunsThatOverflowSkipTheStepsDdpSkips) {
  if (std::string(ampx::torch_version()).rfind("1.", 0) == 0) {
    GTEST_SKIP() << "fp16 on the CPU needs LibTorch 2.x; this is " << ampx::torch_version();
  }
  const std::vector<std::pair<std::string, std::string>> fp16 = {
      {"--dtype", "fp16"}, {"--init-scale", "16777216"}, {"--growth-interval", "3"}};
  for (const std::string mode : {"O1", "O2"}) {
    const ShardRun ddp = run("gpt", "none", mode, fp16);
    const auto skipped = metrics_of("gpt-none-" + mode, mode).skipped_steps;
    // It overflows at first, and again after the scale has grown back.
    ASSERT_GE(skipped.size(), 2u) << mode << ": " << ddp.output;
    ASSERT_LE(skipped.size(), static_cast<size_t>(steps_ / 2)) << mode;
    EXPECT_TRUE(std::adjacent_find(skipped.begin(), skipped.end(),
                                   [](int64_t a, int64_t b) { return b > a + 1; }) != skipped.end())
        << mode << ": no overflow after a clean step";
    EXPECT_EQ(ddp.result.value("skipped", int64_t{-1}), static_cast<int64_t>(skipped.size()));
    for (const std::string shard : {"optimizer", "grad", "full"}) {
      const ShardRun sharded = run("gpt", shard, mode, fp16);
      EXPECT_EQ(metrics_of("gpt-" + shard + "-" + mode, mode).skipped_steps, skipped)
          << mode << " " << shard;
      if (mode == "O1") {
        EXPECT_EQ(losses(sharded), losses(ddp)) << shard;
      } else {
        EXPECT_LT(near(losses(sharded), losses(ddp)), 5e-3) << shard;
      }
    }
  }
}

// The anchor a Python user would pick: PyTorch's FSDP2 (fully_shard per
// block and on the root, bf16 gathers, fp32 reduce-scatters, AdamW) in the
// leg's Python trains the same gpt from the same initial weights on the same
// batches and rows (bench/python/fsdp2_bench.py). ampx's O2 under --shard
// full gives its losses step by step within what keeping the norms in fp32
// and rounding a Linear's bias apart from its product account for (O2's
// tolerance against DDP above). Skipped where the leg's torch has no FSDP2.
TEST_F(ShardTest, FullShardTrainsAsPytorchsFsdp2) {
  const ShardRun full = run("gpt", "full", "O2");
  const fs::path result = tmp_.path() / "fsdp2.json";
  const auto py = ampx::train::test::run_binary_in(tmp_.path(), AMPX_PYTHON,
                                                   {AMPX_FSDP2_SCRIPT,
                                                    "--world",
                                                    "2",
                                                    "--layers",
                                                    "2",
                                                    "--d-model",
                                                    "32",
                                                    "--heads",
                                                    "2",
                                                    "--block-size",
                                                    "8",
                                                    "--batch-size",
                                                    "8",
                                                    "--steps",
                                                    "20",
                                                    "--memory-steps",
                                                    "0",
                                                    "--data-dir",
                                                    (tmp_.path() / "data").string(),
                                                    "--json",
                                                    result.string()});
  if (py.status == 77) GTEST_SKIP() << py.out;
  ASSERT_EQ(py.status, 0) << py.out << py.err;
  std::ifstream in(result);
  const auto fsdp2 = nlohmann::json::parse(in)["losses"].get<std::vector<double>>();
  ASSERT_EQ(losses(full).size(), 20u);
  ASSERT_EQ(fsdp2.size(), 20u);
  for (size_t s = 0; s < 20; ++s) {
    EXPECT_NEAR(losses(full)[s], fsdp2[s], 5e-3 * fsdp2[s]) << "step " << s;
  }
}

// --shard full writes each rank's shard file beside rank 0's checkpoint,
// and a run resumes it on any number of ranks. fp32 gpt, 2 ranks'
// checkpoint at step 4: resumed on 2 ranks, the uninterrupted run's losses
// and weights bit for bit; resumed on 4 (each rank reads both files) to step
// 8, and that 4-rank checkpoint resumed on 2 with --shard grad (the same
// files) to step 12, the losses within 1e-5 of the uninterrupted run's
// (another reduce order; measured 1.1e-7). A save leaves only its own
// step's shard files. A truncated shard file is refused on every rank,
// naming it, and no file is changed.
TEST_F(ShardTest, ShardedCheckpointsResumeOnAnotherNumberOfRanks) {
  const ShardRun reference = train("reference", "full", 2, 12, false);
  const auto expected = losses(reference);
  ASSERT_EQ(expected.size(), 12u);
  train("part", "full", 2, 4, false);
  fs::copy(ck("part"), ck("same"));
  fs::copy(ck("part"), ck("four"));

  const ShardRun same = train("same", "full", 2, 12, true);
  EXPECT_EQ(losses(same), expected);
  EXPECT_EQ(same.result.value("weights_checksum", ""),
            reference.result.value("weights_checksum", ""));

  const ShardRun four = train("four", "full", 4, 8, true);
  EXPECT_LT(near(losses(four), std::vector<double>(expected.begin(), expected.begin() + 8)), 1e-5);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(ck("four"))) files.push_back(e.path().filename());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{
                       "checkpoint-step8-rank0-of4.ampx", "checkpoint-step8-rank1-of4.ampx",
                       "checkpoint-step8-rank2-of4.ampx", "checkpoint-step8-rank3-of4.ampx",
                       "checkpoint.ampx"}));
  const ShardRun back = train("four", "grad", 2, 12, true);
  EXPECT_LT(near(losses(back), expected), 1e-5);

  const fs::path damaged = ck("four") / "checkpoint-step12-rank1-of2.ampx";
  std::map<fs::path, std::string> before;
  fs::resize_file(damaged, fs::file_size(damaged) - 100);
  for (const auto& e : fs::directory_iterator(ck("four"))) before[e.path()] = bytes_of(e.path());
  const ShardRun refused = train("four", "full", 2, 16, true, 1);
  EXPECT_TRUE(contains(refused.output,
                       {"FullyShardedDataParallel::load_shards: nothing was loaded: rank 0 failed: "
                        "ampx-train: checkpoint '" +
                        damaged.string() + "' is truncated"}))
      << refused.output;
  for (const auto& [path, bytes] : before) EXPECT_EQ(bytes_of(path), bytes) << path;
}

// --shard optimizer (ZeRO-1) writes its shard files in the same format:
// fp32 gpt, 2 ranks' checkpoint at step 4 resumed on 2 ranks gives the
// uninterrupted run's losses and weights bit for bit; on 4 ranks (to step
// 8) and under --shard full (to step 12), the losses within 1e-5 of it
// (other reduce orders). A missing shard file is refused on every rank,
// naming it, and no file is changed.
TEST_F(ShardTest, ZeroOneCheckpointsResumeOnAnyNumberOfRanksAndAsFullSharding) {
  const ShardRun reference = train("reference", "optimizer", 2, 12, false);
  const auto expected = losses(reference);
  ASSERT_EQ(expected.size(), 12u);
  train("part", "optimizer", 2, 4, false);
  for (const char* name : {"same", "four", "full"}) fs::copy(ck("part"), ck(name));

  const ShardRun same = train("same", "optimizer", 2, 12, true);
  EXPECT_EQ(losses(same), expected);
  EXPECT_EQ(same.result.value("weights_checksum", ""),
            reference.result.value("weights_checksum", ""));
  const ShardRun four = train("four", "optimizer", 4, 8, true);
  EXPECT_LT(near(losses(four), std::vector<double>(expected.begin(), expected.begin() + 8)), 1e-5);
  const ShardRun full = train("full", "full", 2, 12, true);
  EXPECT_LT(near(losses(full), expected), 1e-5);

  const fs::path missing = ck("same") / "checkpoint-step12-rank1-of2.ampx";
  fs::remove(missing);
  std::map<fs::path, std::string> before;
  for (const auto& e : fs::directory_iterator(ck("same"))) before[e.path()] = bytes_of(e.path());
  const ShardRun refused = train("same", "optimizer", 2, 16, true, 1);
  EXPECT_TRUE(contains(refused.output, {"ZeroRedundancyOptimizer::load_shards: nothing was loaded: "
                                        "rank 0 failed: ",
                                        missing.string()}))
      << refused.output;
  for (const auto& [path, bytes] : before) EXPECT_EQ(bytes_of(path), bytes) << path;
}

// --optimizer-state 8bit under --shard optimizer: the shards carry the
// moments' codes and scales, and a resume on the same ranks trains the
// uninterrupted run's losses and weights bit for bit; an optimizer with
// fp32 moments is refused, naming both formats.
TEST_F(ShardTest, EightBitMomentsInZeroOneCheckpointsResumeBitForBit) {
  // d 64: ZeRO-1's shard of the block's weights is large enough for coded moments.
  const std::vector<std::pair<std::string, std::string>> coded = {{"--optimizer-state", "8bit"},
                                                                  {"--d-model", "64"}};
  const ShardRun reference = train("coded-reference", "optimizer", 2, 8, false, 0, coded);
  ASSERT_EQ(losses(reference).size(), 8u);
  // Each rank's state: half the fp32 masters and 8-bit moments, about 3
  // bytes a parameter (6 with fp32 moments).
  EXPECT_LT(reference.result.value("optimizer_bytes", 0.0),
            4.0 * reference.result.value("params", 0.0));
  train("coded", "optimizer", 2, 4, false, 0, coded);
  const ShardRun resumed = train("coded", "optimizer", 2, 8, true, 0, coded);
  EXPECT_EQ(losses(resumed), losses(reference));
  EXPECT_EQ(resumed.result.value("weights_checksum", ""),
            reference.result.value("weights_checksum", ""));
  const ShardRun other =
      train("coded", "optimizer", 2, 12, true, 1, {{"--d-model", "64"}});  // fp32 moments
  EXPECT_TRUE(contains(other.output, {"the saved shards keep 8bit moments; this optimizer has "
                                      "state_format fp32"}))
      << other.output;
}

// What --shard cannot do yet is refused before anything trains, naming it.
TEST_F(ShardTest, WhatShardingCannotDoIsRefusedNamingTheFlags) {
  const auto error = [&](std::vector<std::string> args) {
    return ampx::train::test::error_text([&] { (void)ampx::train::test::resolved_config(args); });
  };
  auto base = flags("gpt", "full", "O2");
  const auto without_nproc = [&] {
    std::vector<std::string> out;
    for (size_t i = 0; i < base.size(); i += 2) {
      if (base[i] != "--nproc") out.insert(out.end(), {base[i], base[i + 1]});
    }
    return out;
  }();
  EXPECT_TRUE(contains(error(without_nproc),
                       {"--shard full shares the model's state among data-parallel processes; "
                        "give --nproc N"}));
  // A mode the sharding cannot train is refused with the flags, before any rank starts.
  EXPECT_TRUE(contains(error(flags("gpt", "full", "O3")),
                       {"--precision O3 trains without masters; use O2"}));

  const auto config = ampx::train::test::resolved_config(base);
  EXPECT_TRUE(contains(ampx::train::settings_table(config),
                       {"sharding",
                        "full (ZeRO-3): each rank 1/2 of the fp32 masters, "
                        "gradients and AdamW state"}));
  const auto mode_error = [&](const std::string& mode) {
    return ampx::train::test::error_text(
        [&] { ampx::train::check_shard_mode(config, ampx::train::parse_mode(mode, config)); });
  };
  EXPECT_TRUE(contains(mode_error("O3"), {"--precision O3 trains without masters; use O2"}));
  EXPECT_TRUE(contains(mode_error("auto"), {"--shard full with --precision auto: a plan's"}));
  for (const std::string mode : {"fp8", "mxfp8", "nvfp4", "fp8-block"}) {
    EXPECT_EQ(mode_error(mode), "") << mode;
  }
  EXPECT_EQ(mode_error("O2"), "");
}

#endif  // AMPX_TRAIN_BINARY

}  // namespace
