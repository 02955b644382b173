// Failing writes in the real ampx-train binary, on real small filesystems: a
// tmpfs of a few pages mounted by the test (root only; skipped otherwise),
// filled by the run itself, or remounted read-only. A checkpoint, metrics
// or report write that fails stops the run with a message naming the path
// and the cause; the previous checkpoint stays intact and loadable, and no
// temp file is left behind.

#include "run/checkpoint.h"
#include "test_support.h"

#include <gtest/gtest.h>

#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

#ifdef AMPX_TRAIN_BINARY

using ampx::train::read_checkpoint;
using ampx::train::test::contains;
using ampx::train::test::Exit;
using ampx::train::test::run_train;
using ampx::train::test::TempDir;

/// A tmpfs of `bytes` (whole pages) mounted at a new folder `dir`, unmounted
/// when it goes out of scope, a failing test included.
class TmpfsMount {
 public:
  TmpfsMount(const fs::path& dir, size_t bytes) : dir_(dir) {
    fs::create_directories(dir_);
    const std::string options = "size=" + std::to_string(bytes) + ",mode=0755";
    if (::mount("tmpfs", dir_.c_str(), "tmpfs", 0, options.c_str()) != 0) {
      error_ = "mount -t tmpfs -o " + options + " " + dir_.string() + ": " + std::strerror(errno);
    }
  }
  ~TmpfsMount() {
    if (!error_) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  TmpfsMount(const TmpfsMount&) = delete;
  TmpfsMount& operator=(const TmpfsMount&) = delete;

  /// Why it is not mounted (nullopt: it is).
  const std::optional<std::string>& error() const { return error_; }
  void remount_read_only() {
    ASSERT_EQ(::mount("tmpfs", dir_.c_str(), "tmpfs", MS_REMOUNT | MS_RDONLY, nullptr), 0)
        << std::strerror(errno);
  }

 private:
  fs::path dir_;
  std::optional<std::string> error_;
};

constexpr size_t kPage = 4096;

/// Files in `dir` whose names say they are temp files of a write.
std::vector<std::string> temp_files_in(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().find(".tmp.") != std::string::npos) {
      out.push_back(e.path().string());
    }
  }
  return out;
}

class FullDiskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "mounting a tmpfs needs root";
    ampx::train::test::write_text_data(dir_.path() / "data", "abcdefgh ", 20000, 9);
  }

  /// A tiny gpt run of `steps` steps in O2, metrics into `out`, checkpoints
  /// into `ck` every `save_every` steps.
  std::vector<std::string> args(const fs::path& out, const fs::path& ck, int64_t steps,
                                int64_t save_every) const {
    return ampx::train::test::tiny_gpt({{"--precision", "O2"},
                                        {"--data-dir", (dir_.path() / "data").string()},
                                        {"--out-dir", out.string()},
                                        {"--checkpoint-dir", ck.string()},
                                        {"--steps", std::to_string(steps)},
                                        {"--save-every", std::to_string(save_every)},
                                        {"--seed", "9"}});
  }

  /// Mounts a tmpfs of `bytes` at <tmp>/<name>; the test is skipped (with
  /// the reason) when this machine does not allow it.
  std::unique_ptr<TmpfsMount> mount(const std::string& name, size_t bytes) {
    auto m = std::make_unique<TmpfsMount>(dir_.path() / name, bytes);
    return m;
  }

  TempDir dir_;
};

#define AMPX_SKIP_UNLESS_MOUNTED(m) \
  if ((m)->error()) GTEST_SKIP() << "cannot mount a tmpfs here: " << *(m)->error()

TEST_F(FullDiskTest, CheckpointOnFullDiskStopsTheRunAndKeepsThePreviousOne) {
  // How big a checkpoint of this model is: the tmpfs holds one and a half.
  const Exit sizing = run_train(args(dir_.path() / "sizing", dir_.path() / "sizing-ck", 2, 2),
                                dir_.path() / "sizing.log");
  ASSERT_EQ(sizing.status, 0) << sizing.output;
  const size_t pages =
      (fs::file_size(dir_.path() / "sizing-ck" / "checkpoint.ampx") + kPage - 1) / kPage;
  ASSERT_GE(pages, 2u);
  const auto disk = mount("ck", (pages + pages / 2) * kPage);
  AMPX_SKIP_UNLESS_MOUNTED(disk);
  const fs::path ck = dir_.path() / "ck", checkpoint = ck / "checkpoint.ampx";

  // Step 2's checkpoint fits; step 4's needs a second copy until the rename.
  const Exit e = run_train(args(dir_.path() / "out", ck, 10, 2), dir_.path() / "run.log");
  EXPECT_EQ(e.status, 1) << e.output;
  EXPECT_TRUE(contains(e.output,
                       {"cannot write '" + checkpoint.string() + "'", "No space left on device"}));
  EXPECT_EQ(temp_files_in(ck), std::vector<std::string>{});
  // The previous checkpoint: whole, step 2, and ampx-train resumes from it.
  const auto c = read_checkpoint(checkpoint);
  EXPECT_EQ(c.meta.at("step"), 2);
  EXPECT_FALSE(ampx::train::test::model_tensors(checkpoint).empty());
  auto resume = args(dir_.path() / "out", ck, 2, 2);
  resume.push_back("--resume");
  const Exit r = run_train(resume, dir_.path() / "resume.log");
  EXPECT_EQ(r.status, 0) << r.output;
}

TEST_F(FullDiskTest, CheckpointIntoReadOnlyFolderStopsTheRunAndKeepsThePreviousOne) {
  const auto disk = mount("ck", 1024 * kPage);
  AMPX_SKIP_UNLESS_MOUNTED(disk);
  const fs::path ck = dir_.path() / "ck", checkpoint = ck / "checkpoint.ampx";
  const Exit first = run_train(args(dir_.path() / "out", ck, 4, 2), dir_.path() / "first.log");
  ASSERT_EQ(first.status, 0) << first.output;
  const std::string before = ampx::train::test::read_bytes(checkpoint);
  disk->remount_read_only();

  auto resume = args(dir_.path() / "out", ck, 8, 2);
  resume.push_back("--resume");
  const Exit e = run_train(resume, dir_.path() / "resume.log");
  EXPECT_EQ(e.status, 1) << e.output;
  EXPECT_TRUE(
      contains(e.output, {"cannot write '" + checkpoint.string() + "'", "Read-only file system"}));
  EXPECT_EQ(ampx::train::test::read_bytes(checkpoint), before) << "the checkpoint changed";
  EXPECT_EQ(read_checkpoint(checkpoint).meta.at("step"), 4);
}

TEST_F(FullDiskTest, MetricsOnFullDiskStopTheRunNamingTheFileAndEndWithAWholeRecord) {
  const auto disk = mount("out", 2 * kPage);
  AMPX_SKIP_UNLESS_MOUNTED(disk);
  const fs::path out = dir_.path() / "out", ck = dir_.path() / "ck";
  const fs::path metrics = out / "metrics-O2.jsonl";
  const Exit e = run_train(args(out, ck, 400, 5), dir_.path() / "run.log");
  EXPECT_EQ(e.status, 1) << e.output;
  EXPECT_TRUE(contains(e.output, {"cannot write metrics file '" + metrics.string() + "'",
                                  "No space left on device"}));
  // Each line a whole record of consecutive steps; the checkpoint at or before the last.
  std::ifstream in(metrics);
  int64_t lines = 0;
  for (std::string line; std::getline(in, line); ++lines) {
    EXPECT_EQ(nlohmann::json::parse(line).at("step"), lines);
  }
  EXPECT_GT(lines, 5);
  EXPECT_LT(lines, 400);
  const auto c = read_checkpoint(ck / "checkpoint.ampx");
  EXPECT_LE(c.meta.at("step").get<int64_t>(), lines);
  EXPECT_EQ(c.meta.at("step").get<int64_t>() % 5, 0);
  EXPECT_EQ(temp_files_in(out), std::vector<std::string>{});
}

TEST_F(FullDiskTest, ReportOnFullDiskStopsTheRunNamingTheFile) {
  // One page for the metrics of 3 steps, one for the first report file: the next one fails.
  const auto disk = mount("out", 2 * kPage);
  AMPX_SKIP_UNLESS_MOUNTED(disk);
  const fs::path out = dir_.path() / "out", ck = dir_.path() / "ck";
  const Exit e = run_train(args(out, ck, 3, 3), dir_.path() / "run.log");
  EXPECT_EQ(e.status, 1) << e.output;
  EXPECT_TRUE(
      contains(e.output, {"cannot write '" + out.string() + "/", "No space left on device"}));
  EXPECT_EQ(temp_files_in(out), std::vector<std::string>{});
  EXPECT_EQ(read_checkpoint(ck / "checkpoint.ampx").meta.at("step"), 3);
}

#endif  // AMPX_TRAIN_BINARY

}  // namespace
