// The tracking CPU allocator counts real tensor bytes.

#include "ampx/memory.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/resource.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace {

TEST(MemoryTest, CountsAllocationsFreesAndPeak) {
  ampx::enable_cpu_memory_tracking();
  ampx::enable_cpu_memory_tracking();  // idempotent
  ASSERT_TRUE(ampx::cpu_memory_tracking_enabled());
  const auto base = ampx::cpu_memory_stats();
  ampx::reset_peak_cpu_memory();
  {
    auto a = torch::empty({1000, 1000});  // 4,000,000 bytes
    auto b = torch::empty({500}, torch::kBFloat16);  // 1,000 bytes
    EXPECT_EQ(ampx::cpu_memory_stats().allocated_bytes - base.allocated_bytes, 4001000);
  }
  const auto after = ampx::cpu_memory_stats();
  EXPECT_EQ(after.allocated_bytes, base.allocated_bytes);
  EXPECT_EQ(after.peak_allocated_bytes - base.allocated_bytes, 4001000);
  EXPECT_GE(after.allocations - base.allocations, 2);
  ampx::reset_peak_cpu_memory();
  EXPECT_EQ(ampx::cpu_memory_stats().peak_allocated_bytes, after.allocated_bytes);
}

// The tracker counts the bytes each tensor asks for (its 64-byte header is
// not counted), once per allocation; a free gives them back, and the peak is
// the most live at any moment since the reset.
TEST(MemoryTest, ExactBytesAndPeakOfKnownAllocations) {
  ampx::enable_cpu_memory_tracking();
  ASSERT_TRUE(ampx::cpu_memory_tracking_enabled());
  const auto base = ampx::cpu_memory_stats();
  ampx::reset_peak_cpu_memory();
  EXPECT_EQ(ampx::cpu_memory_stats().peak_allocated_bytes, base.allocated_bytes);
  auto a = torch::empty({1000, 1000});                 // 4,000,000 bytes
  auto b = torch::empty({250, 1000}, torch::kDouble);  // 2,000,000 bytes
  auto stats = ampx::cpu_memory_stats();
  EXPECT_EQ(stats.allocated_bytes - base.allocated_bytes, 6000000);
  EXPECT_EQ(stats.peak_allocated_bytes - base.allocated_bytes, 6000000);
  EXPECT_EQ(stats.allocations - base.allocations, 2);
  a.reset();                                        // frees 4,000,000
  auto c = torch::empty({1000}, torch::kBFloat16);  // 2,000 bytes
  stats = ampx::cpu_memory_stats();
  EXPECT_EQ(stats.allocated_bytes - base.allocated_bytes, 2002000);
  EXPECT_EQ(stats.peak_allocated_bytes - base.allocated_bytes, 6000000) << "the peak stays";
  EXPECT_EQ(stats.allocations - base.allocations, 3);
  ampx::reset_peak_cpu_memory();
  EXPECT_EQ(ampx::cpu_memory_stats().peak_allocated_bytes - base.allocated_bytes, 2002000);
  b.reset();
  c.reset();
  stats = ampx::cpu_memory_stats();
  EXPECT_EQ(stats.allocated_bytes, base.allocated_bytes);
  EXPECT_EQ(stats.peak_allocated_bytes - base.allocated_bytes, 2002000);
  EXPECT_EQ(stats.allocations - base.allocations, 3) << "frees are not allocations";
}

TEST(MemoryTest, TensorsWorkNormallyThroughTheTracker) {
  ampx::enable_cpu_memory_tracking();
  ASSERT_TRUE(ampx::cpu_memory_tracking_enabled());
  auto x = torch::randn({64, 64}, torch::requires_grad());
  auto y = torch::mm(x, x).relu().sum();
  y.backward();
  EXPECT_TRUE(x.grad().defined());
  auto r = torch::empty({0});
  const auto before_resize = ampx::cpu_memory_stats();
  r.resize_({128});  // storage growth goes through the allocator too: 512 bytes
  r.fill_(1);
  EXPECT_EQ(r.sum().item<float>(), 128.f);
  const auto before_clone = ampx::cpu_memory_stats();
  EXPECT_EQ(before_clone.allocated_bytes - before_resize.allocated_bytes, 512);
  EXPECT_GT(before_clone.allocations, before_resize.allocations);
  auto c = x.detach().clone();  // 64 * 64 * 4 = 16,384 bytes
  EXPECT_EQ(ampx::cpu_memory_stats().allocated_bytes - before_clone.allocated_bytes, 16384);
  EXPECT_TRUE(torch::equal(c, x.detach()));
}

TEST(MemoryTest, BackwardPeakIsAboveForwardActivations) {
  ampx::enable_cpu_memory_tracking();
  torch::nn::Linear lin(256, 256);
  auto x = torch::randn({512, 256});
  const auto base = ampx::cpu_memory_stats().allocated_bytes;
  ampx::reset_peak_cpu_memory();
  lin->forward(x).pow(2).sum().backward();
  const auto peak = ampx::cpu_memory_stats().peak_allocated_bytes - base;
  // y = lin(x) and z = y^2 (512 KiB each, fp32 [512, 256]) both live until
  // the end of the statement; backward adds at most a few more of that size
  // (dz, dy and pow's temporaries) plus dW (256 KiB) and db (1 KiB).
  constexpr int64_t kActivation = 512 * 256 * 4;
  EXPECT_GE(peak, 2 * kActivation) << "y and y^2 are live at once";
  EXPECT_LE(peak, 6 * kActivation + 256 * 256 * 4 + 256 * 4);
  // After backward only the gradients stay: dW and db.
  EXPECT_EQ(ampx::cpu_memory_stats().allocated_bytes - base, 256 * 256 * 4 + 256 * 4);
}

// The bytes live at the peak by where they were made: the phase
// (CpuMemoryPhaseGuard) and the outermost op, whose own ops (linear's mm,
// ones' empty and fill_) do not count; blocks made before recording as
// "(not recorded)"; together, the peak. A later, lower high leaves the peak
// as it was.
TEST(MemoryOriginsTest, PeakBytesByPhaseAndOutermostOp) {
  ampx::enable_cpu_memory_tracking();
  auto earlier = torch::empty({250});  // 1,000 bytes, tracked before recording
  ampx::start_cpu_memory_origins();
  ampx::reset_peak_cpu_memory();
  torch::Tensor x, w, y, doubled;
  {
    ampx::CpuMemoryPhaseGuard phase("inputs");
    x = torch::ones({100, 50});  // 20,000 bytes
    w = torch::ones({40, 50});   // 8,000
  }
  {
    ampx::CpuMemoryPhaseGuard phase("layer");
    y = torch::linear(x, w);  // 16,000
    {
      ampx::CpuMemoryPhaseGuard inner("scaled");
      doubled = y + y;  // 16,000
    }
  }
  const int64_t peak = ampx::cpu_memory_stats().peak_allocated_bytes;
  y.reset();
  doubled.reset();
  auto later = torch::empty({5000});  // 20,000: less than what was freed
  ampx::stop_cpu_memory_origins();
  using Made = std::pair<int64_t, int64_t>;  // bytes, blocks
  std::map<std::string, Made> by;
  int64_t total = 0, not_recorded = 0;
  for (const auto& o : ampx::peak_cpu_memory_origins()) {
    total += o.bytes;
    if (o.phase == ampx::kNotRecordedPhase) {
      not_recorded = o.bytes;
      continue;
    }
    by[o.phase + "/" + o.op] = {o.bytes, o.blocks};
  }
  EXPECT_EQ(by, (std::map<std::string, Made>{{"inputs/aten::ones", {28000, 2}},
                                             {"layer/aten::linear", {16000, 1}},
                                             {"scaled/aten::add", {16000, 1}}}));
  EXPECT_GE(not_recorded, 1000) << "the block allocated before recording";
  EXPECT_EQ(total, peak);
}

// Gradients are made in backward by their autograd nodes; what is
// allocated after stop_cpu_memory_origins() is not recorded.
TEST(MemoryOriginsTest, GradientsComeFromTheirBackwardNodes) {
  auto w = torch::ones({1000}, torch::requires_grad());
  const auto c = torch::full({1000}, 3.0f);
  ampx::start_cpu_memory_origins();
  ampx::reset_peak_cpu_memory();
  torch::Tensor loss;
  {
    ampx::CpuMemoryPhaseGuard phase("forward");
    loss = (w * c).sum();
  }
  {
    ampx::CpuMemoryPhaseGuard phase("backward");
    loss.backward();
  }
  EXPECT_TRUE(torch::equal(w.grad(), c));
  torch::Tensor big;
  {
    ampx::CpuMemoryPhaseGuard phase("after");
    big = torch::empty({100000});  // 400,000 bytes: the peak
  }
  ampx::stop_cpu_memory_origins();
  auto unrecorded = torch::empty({200000});  // a higher peak, not recorded
  std::map<std::string, std::pair<int64_t, int64_t>> by;
  for (const auto& o : ampx::peak_cpu_memory_origins()) {
    by[o.phase + "/" + o.op] = {o.bytes, o.blocks};
  }
  const auto of = [&](const std::string& origin) {
    const auto it = by.find(origin);
    return it == by.end() ? std::make_pair(int64_t{0}, int64_t{0}) : it->second;
  };
  EXPECT_EQ(of("backward/MulBackward0"), std::make_pair(int64_t{4000}, int64_t{1}));
  EXPECT_EQ(of("after/aten::empty"), std::make_pair(int64_t{400000}, int64_t{1}));
  EXPECT_EQ(by.count("forward/aten::mul"), 0u) << "w * c was freed before the peak";
}

// Minor page faults of this process (all threads) while `step` runs: each is
// a page the kernel mapped and zero-filled anew.
template <typename Step>
int64_t page_faults_of(Step&& step) {
  rusage before{};
  rusage after{};
  getrusage(RUSAGE_SELF, &before);
  step();
  getrusage(RUSAGE_SELF, &after);
  return after.ru_minflt - before.ru_minflt;
}

// What a training step does to the heap: allocate and write eight 12 MiB
// activations (96 MiB), then free them all. With malloc itself: LibTorch's
// tensors come from posix_memalign(64), whose leading and trailing
// remainders glibc keeps as small free chunks in its per-thread cache,
// between the big ones, where they keep freed blocks from merging; in some
// heap layouts (this test under ctest) 3 of the 8 blocks then came from new
// pages every step, with or without the thresholds kept. That is
// fragmentation, not the trimming this is about (docs/performance-notes.md).
void activation_step() {
  std::array<void*, 8> acts{};
  for (auto& a : acts) {
    a = std::malloc(12 << 20);
    ASSERT_NE(a, nullptr);
    std::memset(a, 1, 12 << 20);
  }
  for (void* a : acts) std::free(a);
}

constexpr int64_t kStepPages = (96 << 20) / 4096;

// AddressSanitizer and ThreadSanitizer replace malloc with their own
// allocator (mallopt does nothing there, freed blocks wait in a quarantine):
// glibc's thresholds, which the two tests below are about, do not exist.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr const char* kSanitizerMalloc = "a sanitizer's malloc replaces glibc's";
#else
constexpr const char* kSanitizerMalloc = nullptr;
#endif

// The cost keep_freed_cpu_memory() removes, shown on glibc's defaults: once
// the first free has raised the mmap threshold to 12 MiB, the blocks come
// from the heap, and every step's frees leave 96 MiB free at its top, over
// the (dynamic) trim threshold of 24 MiB: glibc hands it back, and the next
// step faults every page in again.
TEST(MallocRetentionTest, GlibcDefaultsReturnEveryStepsActivations) {
#if !defined(__GLIBC__)
  GTEST_SKIP() << "glibc's malloc only";
#endif
  if (std::getenv("GLIBC_TUNABLES") != nullptr) GTEST_SKIP() << "GLIBC_TUNABLES is set";
  if (kSanitizerMalloc != nullptr) GTEST_SKIP() << kSanitizerMalloc;
  // glibc raises its thresholds for good when a large mmapped block is
  // freed, so what earlier tests of this process allocated would decide the
  // outcome (ctest's shards run many tests in one process): the steps run in
  // a fresh copy of this program, which prints its page faults.
  if (const char* fresh = std::getenv("AMPX_MALLOC_FRESH"); fresh != nullptr) {
    for (int i = 0; i < 3; ++i) activation_step();
    std::printf("[ page faults ] %lld\n", static_cast<long long>(page_faults_of(activation_step)));
    return;
  }
  const std::string cmd =
      "env -u GTEST_TOTAL_SHARDS -u GTEST_SHARD_INDEX -u GTEST_OUTPUT AMPX_MALLOC_FRESH=1 "
      "/proc/" +
      std::to_string(::getpid()) +
      "/exe --gtest_filter=MallocRetentionTest.GlibcDefaultsReturnEveryStepsActivations";
  FILE* child = ::popen(cmd.c_str(), "r");
  ASSERT_NE(child, nullptr) << cmd;
  long long faults = -1;
  char line[512];
  while (std::fgets(line, sizeof(line), child) != nullptr) {
    std::sscanf(line, "[ page faults ] %lld", &faults);
  }
  ASSERT_EQ(::pclose(child), 0) << cmd;
  ASSERT_GE(faults, 0) << "the fresh process printed no page faults: " << cmd;
  EXPECT_GT(faults, kStepPages / 2);
}

// With the thresholds fixed, the pages of one step serve the next: after the
// first steps, a step touches no new page.
TEST(MallocRetentionTest, KeptMemoryServesTheNextStepWithoutPageFaults) {
  const auto r = ampx::keep_freed_cpu_memory();
#if !defined(__GLIBC__)
  EXPECT_FALSE(r.applied);
  EXPECT_EQ(r.reason, "the C library is not glibc");
  GTEST_SKIP() << "glibc's malloc only";
#endif
  if (std::getenv("GLIBC_TUNABLES") != nullptr) GTEST_SKIP() << "GLIBC_TUNABLES is set";
  if (kSanitizerMalloc != nullptr) GTEST_SKIP() << kSanitizerMalloc;
  ASSERT_TRUE(r.applied) << r.reason;
  EXPECT_EQ(r.mmap_threshold, 32 << 20);
  EXPECT_EQ(r.trim_threshold, 1 << 30);
  for (int i = 0; i < 3; ++i) activation_step();
  EXPECT_LT(page_faults_of(activation_step), kStepPages / 20);
}

TEST(MallocRetentionTest, LeavesTheUsersTunablesAndRejectsBadThresholds) {
  ASSERT_EQ(setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=4096", 1), 0);
  const auto r = ampx::keep_freed_cpu_memory();
  unsetenv("GLIBC_TUNABLES");
  EXPECT_FALSE(r.applied);
#if defined(__GLIBC__)
  EXPECT_EQ(r.reason,
            "GLIBC_TUNABLES sets malloc's thresholds already: glibc.malloc.trim_threshold=4096");
#endif
  try {
    ampx::keep_freed_cpu_memory(int64_t{1} << 31);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(e.msg(),
              "keep_freed_cpu_memory: trim_threshold must be in [0, 2147483647] bytes (mallopt "
              "takes an int), got 2147483648");
  }
}

}  // namespace
