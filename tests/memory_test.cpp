// The tracking CPU allocator counts real tensor bytes.

#include "ampx/memory.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

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

TEST(MemoryTest, TensorsWorkNormallyThroughTheTracker) {
  ampx::enable_cpu_memory_tracking();
  auto x = torch::randn({64, 64}, torch::requires_grad());
  auto y = torch::mm(x, x).relu().sum();
  y.backward();
  EXPECT_TRUE(x.grad().defined());
  auto r = torch::empty({0});
  r.resize_({128});  // storage growth goes through the allocator too
  r.fill_(1);
  EXPECT_EQ(r.sum().item<float>(), 128.f);
  auto c = x.detach().clone();
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
  EXPECT_GE(peak, 512 * 256 * 4) << "the activation alone is 512 KiB";
  EXPECT_LT(peak, 64 * 1024 * 1024);
}

}  // namespace
