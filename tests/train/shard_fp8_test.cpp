// ampx-train --shard with FP8 Linears: 2 ranks of gpt trained with each
// sharding against the same run under DistributedDataParallel, the
// Linears' weights gathered as their codes (tensorwise FP8) or as their
// codes and block scales (MXFP8, NVFP4, FP8 blockwise).

#include "shard_fixture.h"
#include "test_support.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

namespace {

#ifdef AMPX_TRAIN_BINARY

using ampx::train::test::contains;
using ampx::train::test::losses;
using ampx::train::test::ShardRun;
using ampx::train::test::ShardTest;

// --precision fp8 (O1 plus FP8 Linears, delayed scaling, amaxes reduced
// over the ranks) under --shard full and grad: the Linears' weights are
// gathered as their E4M3 codes, cast on each rank's fp32 shard with the
// scale of the whole weight, which are the codes DDP's layers cast from
// their fp32 weights: two ranks train DDP's run bit for bit, as they do
// under --shard optimizer, where each rank keeps the whole model.
TEST_F(ShardTest, Fp8TrainsDdpsRunBitForBitGatheringItsWeightsAsCodes) {
  const ShardRun ddp = run("gpt", "none", "fp8");
  ASSERT_EQ(ddp.weights.size(), 2u) << ddp.output;
  ASSERT_EQ(losses(ddp).size(), 20u);
  EXPECT_LT(losses(ddp).back(), losses(ddp).front());
  const ShardRun o1 = run("gpt", "full", "O1");  // the same weights gathered in fp32
  const auto gathered = [](const ShardRun& r) { return r.result.value("gathered_bytes", -1.0); };
  for (const std::string shard : {"full", "grad", "optimizer"}) {
    const ShardRun sharded = run("gpt", shard, "fp8");
    EXPECT_EQ(losses(sharded), losses(ddp)) << shard;
    EXPECT_EQ(sharded.weights, std::vector<std::string>(2, ddp.weights[0])) << shard;
    if (shard != "optimizer") {  // ZeRO-1 gathers no weights: the model stays whole
      EXPECT_TRUE(contains(sharded.output, {"fp8: the FP8 Linears' weights as their E4M3 codes"}))
          << sharded.output;
    }
    if (shard == "full") {  // a byte an element where O1 gathers 4
      EXPECT_GT(gathered(sharded), 0.0);
      EXPECT_LT(gathered(sharded), 0.6 * gathered(o1));
    }
  }
}

// Block-scaled Linears (MXFP8, NVFP4, FP8 blockwise) under --shard full and
// grad: each rank quantizes its rows of the fp32 masters, whole blocks of
// them, which are the codes and scales DDP's layers make of their fp32
// weights, and the ranks gather those: two ranks train DDP's run bit for
// bit (NVFP4's stochastic gradients and Hadamard transforms included), as
// they do under --shard optimizer, where each rank keeps the whole model;
// under --shard full the gathered working set is smaller than O1's (float32
// gathers of the same weights) for MXFP8 and NVFP4. FP8 blockwise's 128-row
// blocks would pad this 32-wide model's weights past twice their rows: they
// are gathered in float32, the same training.
TEST_F(ShardTest, BlockScaledTrainDdpsRunBitForBitGatheringCodesAndScales) {
  const ShardRun o1 = run("gpt", "full", "O1");
  const auto gathered = [](const ShardRun& r) { return r.result.value("gathered_bytes", -1.0); };
  // Every Linear block-scaled (nvfp4 keeps 2 layers' blocks in bf16 by default).
  const std::vector<std::pair<std::string, std::string>> all_linears = {{"--bf16-layers", "none"}};
  for (const std::string mode : {"mxfp8", "nvfp4", "fp8-block"}) {
    SCOPED_TRACE(mode);
    const ShardRun ddp = run("gpt", "none", mode, all_linears);
    ASSERT_EQ(ddp.weights.size(), 2u) << ddp.output;
    ASSERT_EQ(losses(ddp).size(), 20u);
    EXPECT_LT(losses(ddp).back(), losses(ddp).front());
    const std::vector<std::string> shards =
        mode == "mxfp8" ? std::vector<std::string>{"full", "grad", "optimizer"}
                        : std::vector<std::string>{"full"};
    for (const auto& shard : shards) {
      const ShardRun sharded = run("gpt", shard, mode, all_linears);
      EXPECT_EQ(losses(sharded), losses(ddp)) << shard;
      EXPECT_EQ(sharded.weights, std::vector<std::string>(2, ddp.weights[0])) << shard;
      if (shard != "optimizer") {
        EXPECT_TRUE(contains(
            sharded.output,
            {mode +
             ": the Linears' weights as their codes and block scales (unless mostly padding)"}))
            << sharded.output;
      }
      if (shard == "full" && mode != "fp8-block") {
        EXPECT_GT(gathered(sharded), 0.0);
        EXPECT_LT(gathered(sharded), gathered(o1));
      }
    }
  }
}

#endif  // AMPX_TRAIN_BINARY

}  // namespace
