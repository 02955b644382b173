// FullyShardedDataParallel's full-state export: rank 0 streams a
// safetensors file a unit at a time (save_full_safetensors) instead of
// holding the whole model (full_state_dict), and what it writes is
// save_safetensors()'s file of the whole model, byte for byte. The worker
// (tests/helpers/fsdp_worker_export.cpp) runs on 2 and 3 ranks.

#include "../rank_launch.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

using ::testing::HasSubstr;

#ifdef AMPX_FSDP_WORKER

class FsdpExportTest : public ::testing::TestWithParam<int> {
 protected:
  ampx_test::TempFolder tmp_{"ampx-fsdp-export"};
  fs::path dir_ = tmp_.path();
};

// The streamed files (parameters in fp32, then in bf16, both with the
// buffers) are the whole-model files byte for byte. What cannot be written
// is refused on every rank, naming rank 0's error, with nothing left
// behind: a missing folder (the temp file cannot be made), a path that is
// a folder (every tensor written, the rename fails: the folder stays as
// it was), a dtype the export does not take, metadata that is not UTF-8
// (the header could not be read back); a visitor that throws on
// rank 0 stops being called there while the gathers go on, and a later
// export on the same ranks still works.
TEST_P(FsdpExportTest, StreamedExportIsSaveSafetensorsOfTheWholeModelAndFailsOnEveryRank) {
  const int world = GetParam();
  auto workers =
      ampx_test::run_ranks(AMPX_FSDP_WORKER, dir_, "export", world, std::chrono::seconds(120));
  ASSERT_EQ(workers.size(), static_cast<size_t>(world));
  const std::string out = workers[0].out.string();
  const std::string whole = ampx_test::file_bytes(out + ".whole"),
                    whole_bf16 = ampx_test::file_bytes(out + ".whole-bf16");
  ASSERT_GT(whole.size(), 4u * (8 * 48 + 48 * 40 + 40 * 4));
  EXPECT_EQ(ampx_test::file_bytes(out + ".streamed"), whole);
  EXPECT_EQ(ampx_test::file_bytes(out + ".streamed-bf16"), whole_bf16);
  EXPECT_LT(whole_bf16.size(), whole.size());
  EXPECT_EQ(ampx_test::file_bytes(out + ".after"), whole);

  const std::string who = "FullyShardedDataParallel::save_full_safetensors: rank 0 failed: ";
  const std::string taken = (dir_ / "taken.safetensors").string();
  for (const auto& w : workers) {
    EXPECT_EQ(w.status, 0) << w.output;
    EXPECT_THAT(
        w.output,
        HasSubstr("refused missing-folder: " + who + "writing safetensors: cannot write '" +
                  (dir_ / "missing" / "w.safetensors").string() + "': creating its temp file"));
    EXPECT_THAT(w.output,
                HasSubstr("refused over-folder: " + who + "writing safetensors: cannot write '" +
                          taken + "': renaming '" + taken + ".tmp."));
    EXPECT_THAT(w.output, HasSubstr("refused dtype: FullyShardedDataParallel::"
                                    "save_full_safetensors: dtype is Int; the parameters are "
                                    "written in Float, BFloat16 or Half"));
    EXPECT_THAT(w.output, HasSubstr("refused not-utf8: " + who +
                                    "writing safetensors: the value of metadata key 'note' is "
                                    "not UTF-8, which a safetensors header (JSON) must be"));
    EXPECT_THAT(w.output, HasSubstr("refused visit: FullyShardedDataParallel::"
                                    "for_each_full_parameter: rank 0 failed: cannot take in.bias"));
  }
  EXPECT_THAT(workers[0].output, HasSubstr("visited 2\n"));  // none after the throw
  EXPECT_THAT(workers[1].output, HasSubstr("visited 0\n"));
  EXPECT_TRUE(fs::is_directory(fs::path(taken) / "kept"));
  EXPECT_FALSE(fs::exists(out + ".latin1"));
  for (const auto& e : fs::recursive_directory_iterator(dir_)) {
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
  }
}

INSTANTIATE_TEST_SUITE_P(World, FsdpExportTest, ::testing::Values(2, 3));

#endif  // AMPX_FSDP_WORKER

}  // namespace
