// FullyShardedDataParallel's FP8 all-gather (fp8_all_gather): the weights of
// FP8 layers gathered as their E4M3 codes, and block-scaled layers' as their
// codes and scales, train as the weights gathered at full width do. The
// workers (tests/helpers/fsdp_worker_fp8.cpp, fsdp_worker_block.cpp) run on
// 2 and 3 ranks.

#include "../rank_launch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

#ifdef AMPX_FSDP_WORKER

/// What the worker wrote for one run.
struct GatherRun {
  std::vector<double> losses, params;
  double eval = 0.0, scale = 0.0;
  int64_t bytes = -1, peak = -1;
  int64_t peak2 = -1;  // after the second step, where written
};

GatherRun read_run(const fs::path& path) {
  GatherRun r;
  std::ifstream in(path);
  std::string kind, value;
  while (in >> kind >> value) {
    const double v = std::strtod(value.c_str(), nullptr);
    if (kind == "loss") r.losses.push_back(v);
    if (kind == "param") r.params.push_back(v);
    if (kind == "eval") r.eval = v;
    if (kind == "scale") r.scale = v;
    if (kind == "bytes") r.bytes = std::stoll(value);
    if (kind == "peak") r.peak = std::stoll(value);
    if (kind == "peak2") r.peak2 = std::stoll(value);
  }
  return r;
}

class FsdpFp8GatherTest : public ::testing::TestWithParam<int> {
 protected:
  ampx_test::TempFolder tmp_{"ampx-fsdp-fp8"};
  fs::path dir_ = tmp_.path();
};

/// The largest difference of a's values from b's, relative to b's or to
/// `floor` where b's are smaller (inf: other lengths, or none).
double gap(const std::vector<double>& a, const std::vector<double>& b, double floor = 1e-3) {
  double worst = a.size() == b.size() && !a.empty() ? 0.0 : INFINITY;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(std::abs(b[i]), floor));
  }
  return worst;
}

/// The codes run `codes` trains as the full-width run `wide`: the first loss
/// bit for bit, the rest and the weights within `within` (the weights
/// relative to the larger of theirs and 0.1); and `wide` trains.
void expect_same_training(const GatherRun& codes, const GatherRun& wide, double within,
                          double trained_below) {
  ASSERT_EQ(wide.losses.size(), 5u);
  ASSERT_EQ(codes.params.size(), wide.params.size());
  ASSERT_FALSE(wide.params.empty());
  EXPECT_EQ(codes.losses.front(), wide.losses.front());
  EXPECT_LE(gap(codes.losses, wide.losses), within);
  EXPECT_LE(gap(codes.params, wide.params, 0.1), within);
  EXPECT_LT(wide.losses.back(), trained_below * wide.losses.front());
}

/// The values of the lines starting `tag` in <out>.gathers, and the rest of
/// the line of each other tag.
struct Gathers {
  std::map<std::string, std::vector<double>> values;
  std::map<std::string, std::string> text;
};

Gathers read_gathers(const fs::path& path) {
  Gathers g;
  std::ifstream in(path);
  std::string tag, rest;
  while (in >> tag && std::getline(in, rest)) {
    rest = rest.substr(1);
    if (tag.rfind("refused-", 0) == 0) {
      g.text[tag] = rest;
    } else {
      g.values[tag].push_back(std::strtod(rest.c_str(), nullptr));
    }
  }
  return g;
}

// With param_dtype float32 a weight gathered as codes is cast once, on the
// shards, with the scale of the whole weight, and the whole weight's amax
// is recorded: the codes and scales are those of the layer casting the
// gathered float32 weight itself, under delayed scaling (whose scale
// changes between a forward and the gather again for its backward) and
// current scaling, in ZeRO-3 (with and without prefetch) and ZeRO-2. The
// first loss is the same bit for bit; on 2 ranks (one order of every sum)
// so is the whole training. On 3 the FP8 weights' own flat space sums their
// gradients in another order, and a master one ulp away may round to
// another code: the losses within 1e-3, the weights within 1e-3 of the
// larger of theirs and 0.1. An evaluation whose region ends after the first
// block computes the second (prefetched as codes) at full width, as the
// full-width run does. The codes move a byte an element: what the float32
// runs save is three times what the bfloat16 runs save (3 bytes and 1 an
// element of the same gathers; exactly where no space is padded), and the
// gathered peak is lower. With param_dtype bfloat16 the codes come from the
// fp32 masters (one rounding, not two): their losses stay as near the
// float32 run's as the bfloat16 gather's (within 1.5x its gap, or 3%).
TEST_P(FsdpFp8GatherTest, CodesTrainAsTheFullWidthGatherAndMoveAByteAnElement) {
  const int world = GetParam();
  auto workers =
      ampx_test::run_ranks(AMPX_FSDP_WORKER, dir_, "fp8-gather", world, std::chrono::seconds(240));
  ASSERT_EQ(workers.size(), static_cast<size_t>(world));
  for (const auto& w : workers) ASSERT_EQ(w.status, 0) << w.output;
  const auto run = [&](const std::string& name, int rank = 0) {
    return read_run(workers[rank].out.string() + "." + name);
  };
  const double within = world == 2 ? 0.0 : 1e-3;
  for (const std::string name : {"delayed-fp32-codes", "delayed-fp32-codes-zero2",
                                 "delayed-fp32-codes-noprefetch", "current-fp32-codes"}) {
    SCOPED_TRACE(name);
    const std::string wide_name = name.substr(0, name.find("-codes"));
    const GatherRun wide = run(wide_name), codes = run(name);
    expect_same_training(codes, wide, within, 0.5);
    EXPECT_LE(gap({codes.scale}, {wide.scale}), within);
    EXPECT_LE(gap({codes.eval}, {wide.eval}), within);
    EXPECT_GT(wide.scale, 100.0);                              // the scales moved from 1
    for (int r = 1; r < world; ++r) {                          // every rank's own batch
      EXPECT_LE(gap(run(name, r).losses, run(wide_name, r).losses), within);
    }
  }
  // Casts are taken again after a step: an evaluation in the FP8 region
  // between each backward and its step (current scaling: it changes no
  // scaling state) changes nothing, under torch::NoGradGuard or with
  // gradients recorded (a forward no backward follows), in ZeRO-3 and in
  // ZeRO-2 (which keeps such a forward's units gathered until the step),
  // its output dropped (no graph of it alive) or kept past the next
  // forward (the step seen through the masters' version counters).
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const auto losses = run("current-fp32-codes", r).losses;
    ASSERT_EQ(losses.size(), 5u);
    EXPECT_EQ(run("current-fp32-codes-eval", r).losses, losses);
    EXPECT_EQ(run("current-fp32-codes-eval-grad", r).losses, losses);
    EXPECT_EQ(run("current-fp32-codes-zero2-eval-grad", r).losses, losses);
    EXPECT_EQ(run("current-fp32-zero2-eval-grad", r).losses, run("current-fp32", r).losses);
    EXPECT_EQ(run("current-fp32-codes-zero2-eval-kept", r).losses, losses);
    EXPECT_EQ(run("current-fp32-zero2-eval-kept", r).losses, run("current-fp32", r).losses);
    // LibTorch's SGD writes through .data(), whose version counter is not
    // the master's: a dropped evaluation's units go for their dead graph.
    EXPECT_EQ(run("current-fp32-zero2-eval-grad-sgd", r).losses, run("current-fp32-sgd", r).losses);
  }
  {  // delayed scaling: the evaluation records amaxes; as the full-width run's
    SCOPED_TRACE("delayed-fp32-codes-eval-grad");
    expect_same_training(run("delayed-fp32-codes-eval-grad"), run("delayed-fp32-eval-grad"), within,
                         0.5);
  }
  const GatherRun wide32 = run("delayed-fp32"), codes32 = run("delayed-fp32-codes");
  const GatherRun wide16 = run("delayed-bf16"), codes16 = run("delayed-bf16-codes");
  ASSERT_GT(wide16.bytes, codes16.bytes);
  if (world == 2) {  // every space of an even size: no padding
    EXPECT_EQ(wide32.bytes - codes32.bytes, 3 * (wide16.bytes - codes16.bytes));
  } else {  // the FP8 weights' space padded on its own
    EXPECT_NEAR(static_cast<double>(wide32.bytes - codes32.bytes) /
                    static_cast<double>(wide16.bytes - codes16.bytes),
                3.0, 0.05);
  }
  EXPECT_LT(codes32.peak, wide32.peak);
  EXPECT_LT(codes16.peak, wide16.peak);
  EXPECT_LT(codes16.losses.back(), 0.5 * codes16.losses.front());
  EXPECT_LE(gap(codes16.losses, wide32.losses),
            std::max(0.03, 1.5 * gap(wide16.losses, wide32.losses)));
}

// One backward's forwards may gather a unit more than once: under ZeRO-3
// each gather writes the storage the earlier forwards' codes were saved
// from, so every gather of one backward casts with the same scales, even
// where delayed scaling moved the weight's scale between the forwards (two
// forwards summed into one loss): the gradients are ZeRO-2's, which gathers
// once, bit for bit. An evaluation outside the FP8 region between a forward
// and its backward gathers at full width and leaves the backward the
// forward's codes: the gradients of the run without it, bit for bit, in
// ZeRO-3 and ZeRO-2. A layer that runs outside FP8 inside a unit gathered
// as codes, and a forward outside the region before the backward of one
// inside it, are refused naming what to do.
TEST_P(FsdpFp8GatherTest, EveryGatherOfOneBackwardWritesTheSameCodes) {
  const int world = GetParam();
  auto workers =
      ampx_test::run_ranks(AMPX_FSDP_WORKER, dir_, "fp8-gather", world, std::chrono::seconds(240));
  ASSERT_EQ(workers.size(), static_cast<size_t>(world));
  for (const auto& w : workers) ASSERT_EQ(w.status, 0) << w.output;
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const Gathers g = read_gathers(workers[r].out.string() + ".gathers");
    const auto& clean = g.values.at("zero3-clean");
    ASSERT_FALSE(clean.empty());
    EXPECT_NE(gap(g.values.at("zero3-twice"), clean), 0.0);  // two forwards: other gradients
    EXPECT_EQ(g.values.at("zero3-twice"), g.values.at("zero2-twice"));
    EXPECT_EQ(g.values.at("zero3-eval-between"), clean);
    EXPECT_EQ(g.values.at("zero2-eval-between"), g.values.at("zero2-clean"));
    EXPECT_EQ(g.values.at("zero2-clean"), clean);
    EXPECT_NE(g.text.at("refused-off")
                  .find("ampx::fp8::Linear: its weight was gathered as FP8 "
                        "codes for an FP8 region"),
              std::string::npos)
        << g.text.at("refused-off");
    EXPECT_NE(g.text.at("refused-two-ways")
                  .find("FullyShardedDataParallel: unit 'in' was gathered for a forward inside "
                        "an FP8 region"),
              std::string::npos)
        << g.text.at("refused-two-ways");
  }
}

INSTANTIATE_TEST_SUITE_P(World, FsdpFp8GatherTest, ::testing::Values(2, 3));

class FsdpBlockGatherTest : public ::testing::TestWithParam<int> {
 protected:
  /// The worker's block-gather scenario on GetParam() ranks.
  std::vector<ampx_test::Worker> run_workers() {
    auto workers = ampx_test::run_ranks(AMPX_FSDP_WORKER, dir_, "block-gather", GetParam(),
                                        std::chrono::seconds(300));
    EXPECT_EQ(workers.size(), static_cast<size_t>(GetParam()));
    for (const auto& w : workers) EXPECT_EQ(w.status, 0) << w.output;
    return workers;
  }
  ampx_test::TempFolder tmp_{"ampx-fsdp-block"};
  fs::path dir_ = tmp_.path();
};

// A block-scaled layer's weight gathered as its codes and scales: each rank
// quantizes its rows of the fp32 master, whole blocks of them, which are the
// codes and scales of the layer's own quantization of the gathered float32
// weight, under MXFP8 (1 x 32: the row-wise copy for a forward, the
// column-wise one for a backward, both kept from forward to backward under
// ZeRO-2; and 32 x 32), NVFP4 (16 x 16 and 1 x 16, with the whole weight's
// amax; stochastic gradients and Hadamard transforms as the layer draws
// them) and FP8 blockwise. On 2 ranks the training is the float32 gather's
// bit for bit; on 3, where the weights' own spaces sum their gradients in
// another order, the first loss is, the rest within 1e-3 (weights within
// 1e-3 of the larger of theirs and 0.1). Fewer bytes move than in float32
// and the gathered peak is lower (FP4 codes two to a byte: NVFP4 saves more
// than MXFP8), the same after the second step (the first prefetches
// nothing) as after the last; FP8
// blockwise's 128-row blocks, which would pad these weights to more than
// twice their rows, leave them to the float32 gather (the same run, byte for
// byte); with param_dtype bfloat16 the peak is below the bfloat16
// gather's (the bytes moved are not: these weights' rows are padded to
// whole blocks on each rank, a third more, and so are their float32
// reduce-scatters), the codes come from the fp32 masters, and the losses
// stay as near the float32 run's as the bfloat16 gather's. NVFP4's whole
// amaxes are taken anew after load_shards() (a resumed run is the
// uninterrupted one bit for bit).
TEST_P(FsdpBlockGatherTest, CodesAndScalesTrainAsTheFullWidthGather) {
  const int world = GetParam();
  const auto workers = run_workers();
  ASSERT_EQ(workers.size(), static_cast<size_t>(world));
  const auto run = [&](const std::string& name, int rank = 0) {
    return read_run(workers[rank].out.string() + "." + name);
  };
  const double within = world == 2 ? 0.0 : 1e-3;
  for (const std::string name :
       {"mxfp8-codes", "mxfp8-codes-zero2", "mxfp8-codes-noprefetch", "mxfp8-2d-codes",
        "nvfp4-codes", "nvfp4-1d-codes", "nvfp4-1d-codes-zero2", "blockwise-codes"}) {
    SCOPED_TRACE(name);
    const std::string wide_name = name.substr(0, name.find("-codes"));
    const GatherRun wide = run(wide_name), codes = run(name);
    expect_same_training(codes, wide, within, 0.8);
    EXPECT_LT(codes.bytes, wide.bytes);
    EXPECT_LT(codes.peak, wide.peak);
    EXPECT_EQ(codes.peak2, codes.peak);  // every step frees what it gathered
    for (int r = 1; r < world; ++r) {  // every rank's own batch
      EXPECT_LE(gap(run(name, r).losses, run(wide_name, r).losses), within);
    }
  }
  // 128-row blocks would make every weight here mostly padding: they are
  // gathered in float32 with their units, as without the option.
  const GatherRun wide128 = run("blockwise128"), codes128 = run("blockwise128-codes");
  EXPECT_EQ(codes128.losses, wide128.losses);
  EXPECT_EQ(codes128.bytes, wide128.bytes);
  EXPECT_EQ(codes128.peak, wide128.peak);
  // NVFP4's whole amaxes are taken again after load_shards() (a run saved
  // after its second step, stepped and evaluated in the FP8 region once
  // more, then loaded, trains its last three steps as the run without
  // them) and after a step (an evaluation in the region between each
  // backward and its step changes nothing, with gradients recorded or not,
  // in ZeRO-3 and ZeRO-2).
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const auto losses = run("nvfp4-codes", r).losses;
    ASSERT_EQ(losses.size(), 5u);
    EXPECT_EQ(run("nvfp4-codes-resume", r).losses, losses);
    EXPECT_EQ(run("nvfp4-codes-eval", r).losses, losses);
    EXPECT_EQ(run("nvfp4-codes-eval-grad", r).losses, losses);
    EXPECT_EQ(run("nvfp4-codes-zero2-eval-grad", r).losses, losses);
    EXPECT_EQ(run("nvfp4-codes-zero2-eval-kept", r).losses, losses);
  }
  const auto saved = [&](const std::string& name) {
    return run(name).bytes - run(name + "-codes").bytes;
  };
  EXPECT_GT(saved("nvfp4-1d"), saved("mxfp8"));  // half a byte an element, not one
  // ZeRO-2 gathers both copies for the forward and keeps them: its peak
  // holds a byte more an element of every block-scaled weight (21,504 in
  // all) than ZeRO-3's, which gathers the column-wise copy for the backward.
  EXPECT_GE(run("mxfp8-codes-zero2").peak - run("mxfp8-codes").peak, 21504);
  const GatherRun wide32 = run("mxfp8"), wide16 = run("mxfp8-bf16");
  const GatherRun codes16 = run("mxfp8-bf16-codes");
  EXPECT_LT(codes16.peak, wide16.peak);
  EXPECT_LE(gap(codes16.losses, wide32.losses),
            std::max(0.03, 1.5 * gap(wide16.losses, wide32.losses)));
}

// Every gather of one backward's forwards quantizes the same masters (NVFP4
// with the same whole amax), so it writes the same codes and scales into
// the storage the earlier forwards saved theirs from, under MXFP8 and
// NVFP4, with a copy for each product (1 x 32, 1 x 16) or one for both
// (32 x 32, 16 x 16): two forwards summed into one loss give ZeRO-2's
// gradients (one gather) under ZeRO-3; an evaluation between a forward and
// its backward, outside the FP8 region (gathering at full width) or inside
// it (gathering the forward's codes again under ZeRO-3, the ones kept
// under ZeRO-2), leaves the backward the gradients of the run without it,
// bit for bit, under ZeRO-3 and ZeRO-2.
TEST_P(FsdpBlockGatherTest, EveryGatherOfOneBackwardWritesTheSameCodesAndScales) {
  const auto workers = run_workers();
  for (size_t r = 0; r < workers.size(); ++r) {
    const Gathers g = read_gathers(workers[r].out.string() + ".block-gathers");
    for (const std::string recipe : {"mxfp8", "mxfp8-2d", "nvfp4", "nvfp4-1d"}) {
      SCOPED_TRACE("rank " + std::to_string(r) + ", " + recipe);
      const auto values = [&](const std::string& tag) { return g.values.at(recipe + "-" + tag); };
      const auto clean = values("zero3-clean");
      ASSERT_FALSE(clean.empty());
      EXPECT_NE(gap(values("zero3-twice"), clean), 0.0);  // two forwards: other gradients
      EXPECT_EQ(values("zero3-twice"), values("zero2-twice"));
      EXPECT_EQ(values("zero2-clean"), clean);
      for (const std::string zero : {"zero3", "zero2"}) {
        EXPECT_EQ(values(zero + "-eval-between"), clean) << zero;
        EXPECT_EQ(values(zero + "-eval-fp8-between"), clean) << zero;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(World, FsdpBlockGatherTest, ::testing::Values(2, 3));

#endif  // AMPX_FSDP_WORKER

}  // namespace
