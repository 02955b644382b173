#pragma once

// What policy_test.cpp and policy_norms_test.cpp share: PolicyTest, which
// checks that no test leaks a policy, the custom op ampx_test::scale_add
// (registered once, in policy_test.cpp) and the dtypes its kernel saw.

#include "ampx/policy.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace policy_test {

/// The dtypes ampx_test::scale_add's CPU kernel saw last.
inline at::ScalarType g_seen_a = at::kDouble;
inline at::ScalarType g_seen_b = at::kDouble;

/// ampx_test::scale_add's CPU kernel (a + 2 b); records the dtypes it saw.
inline at::Tensor scale_add_cpu(const at::Tensor& a, const at::Tensor& b) {
  g_seen_a = a.scalar_type();
  g_seen_b = b.scalar_type();
  return a + 2 * b;
}

/// Calls ampx_test::scale_add through the dispatcher (and so through autocast).
inline at::Tensor scale_add(const at::Tensor& a, const at::Tensor& b) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ampx_test::scale_add", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(a, b);
}

/// A random normal tensor of `shape`, as `dtype`.
inline torch::Tensor rnd(std::vector<int64_t> shape, torch::Dtype dtype = torch::kFloat) {
  return torch::randn(shape).to(dtype);
}

class PolicyTest : public ::testing::Test {
 protected:
  void TearDown() override {
    // Policies are process-wide: no test may leak one into the next.
    EXPECT_TRUE(ampx::get_all_cast_policies(torch::kCPU).empty());
    EXPECT_TRUE(ampx::get_all_cast_policies(torch::kCUDA).empty());
  }
};

}  // namespace policy_test
