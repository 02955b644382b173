// ZeroRedundancyOptimizer's collectives in pieces (bucket_bytes): a step
// holds buffers of at most that size however large a space is, and trains
// the parameters of one piece a space. The worker
// (tests/helpers/fsdp_worker_zero_pieces.cpp) runs on 2 and 3 ranks.

#include "../rank_launch.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

using ::testing::HasSubstr;

#ifdef AMPX_FSDP_WORKER

/// The "param" values and the "bytes" count of a file the worker wrote.
struct Trained {
  std::vector<float> params;
  int64_t bytes = -1;
};

Trained read_trained(const fs::path& path) {
  Trained t;
  std::ifstream in(path);
  std::string kind, value;
  while (in >> kind >> value) {
    if (kind == "param") t.params.push_back(std::strtof(value.c_str(), nullptr));
    if (kind == "bytes") t.bytes = std::stoll(value);
  }
  return t;
}

class ZeroPiecesTest : public ::testing::TestWithParam<int> {
 protected:
  ampx_test::TempFolder tmp_{"ampx-zero-pieces"};
  fs::path dir_ = tmp_.path();
};

// Pieces of 24 bytes (3 fp32 elements a rank on 2 ranks, 2 on 3; 6 and 4
// bf16) cross every parameter's edges and the padding, in the fp32 space
// and in the bf16 one. On 2 ranks every sum is a + b whatever the pieces:
// the weights are those of one piece a space, bit for bit. On 3, Gloo's
// all-reduce may add a piece's three gradients in another order: the fp32
// weights agree within 1e-5, the bf16 ones within one of their steps
// (at most 2^-7 of their size). Both are near the same steps taken in one
// process on every rank's batch. Every rank holds the same
// weights, the same bytes are communicated, and bucket_bytes 0 is refused
// naming its value. The trained masters stream into safetensors a piece at
// a time: the file of the gathered masters, byte for byte; a write that
// cannot be made is refused on every rank.
TEST_P(ZeroPiecesTest, PiecesTrainTheWeightsOfOnePieceASpace) {
  const int world = GetParam();
  auto workers =
      ampx_test::run_ranks(AMPX_FSDP_WORKER, dir_, "zero-pieces", world, std::chrono::seconds(120));
  ASSERT_EQ(workers.size(), static_cast<size_t>(world));
  const Trained whole = read_trained(workers[0].out.string() + ".whole");
  const Trained pieces = read_trained(workers[0].out.string() + ".pieces");
  constexpr size_t kFp32 = 41 * 6 + 41, kAll = kFp32 + 5 * 41 + 5 + 1;
  ASSERT_EQ(whole.params.size(), kAll);
  ASSERT_EQ(pieces.params.size(), kAll);
  EXPECT_GT(whole.bytes, 0);
  EXPECT_EQ(pieces.bytes, whole.bytes);
  if (world == 2) {
    EXPECT_EQ(pieces.params, whole.params);
  } else {
    for (size_t i = 0; i < kAll; ++i) {
      const float bound = i < kFp32 ? 1e-5f : std::abs(whole.params[i]) / 128.f;
      EXPECT_LE(std::abs(pieces.params[i] - whole.params[i]), bound) << "parameter element " << i;
    }
  }
  // Each rank's pieces in their place: what one process trains on every
  // rank's batch, up to the rounding of the bf16 layer's gradients (each
  // rank's in bf16, averaged in fp32, against one bf16 gradient of the
  // mean: 2^-9 of a gradient, 6 steps of SGD with momentum).
  const Trained unsharded = read_trained(workers[0].out.string() + ".unsharded");
  ASSERT_EQ(unsharded.params.size(), kAll);
  float fp32_apart = 0, bf16_apart = 0;
  for (size_t i = 0; i < kAll; ++i) {
    float& apart = i < kFp32 ? fp32_apart : bf16_apart;
    apart = std::max(apart, std::abs(pieces.params[i] - unsharded.params[i]));
  }
  EXPECT_LT(fp32_apart, 1e-3f);  // measured 2.6e-4 (2 ranks), 1.2e-4 (3)
  EXPECT_LT(bf16_apart, 5e-3f);  // measured 2^-9, one bf16 step at 0.25-0.5
  for (const auto& w : workers) {
    EXPECT_EQ(w.status, 0) << w.output;
    EXPECT_EQ(read_trained(w.out.string() + ".pieces").params, pieces.params) << w.output;
    EXPECT_THAT(w.output, HasSubstr("refused bucket: ZeroRedundancyOptimizer: bucket_bytes must "
                                    "be > 0, got 0"));
    EXPECT_THAT(w.output, HasSubstr("refused export: ZeroRedundancyOptimizer::"
                                    "save_full_safetensors: rank 0 failed: writing safetensors: "
                                    "cannot write '" +
                                    (dir_ / "missing" / "w.safetensors").string() +
                                    "': creating its temp file"));
  }
  // The masters streamed to safetensors a piece at a time are rank 0's file
  // of gather_masters() (every rank holding every master), byte for byte.
  const std::string exported = workers[0].out.string() + ".pieces";
  ASSERT_GT(ampx_test::file_bytes(exported + ".gathered").size(), 4 * kAll);
  EXPECT_EQ(ampx_test::file_bytes(exported + ".streamed"),
            ampx_test::file_bytes(exported + ".gathered"));
  EXPECT_EQ(ampx_test::file_bytes(exported + ".streamed-bf16"),
            ampx_test::file_bytes(exported + ".gathered-bf16"));
  EXPECT_NE(ampx_test::file_bytes(exported + ".streamed-bf16"),
            ampx_test::file_bytes(exported + ".streamed"));
}

INSTANTIATE_TEST_SUITE_P(World, ZeroPiecesTest, ::testing::Values(2, 3));

#endif  // AMPX_FSDP_WORKER

}  // namespace
