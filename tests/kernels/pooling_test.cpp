// ampx::max_pool2d (ampx/kernels/pooling.h): LibTorch's max_pool2d bit for
// bit, forward and backward, on inputs full of ties (a ReLU's zeros), NaN,
// infinities and signed zeros, in every floating dtype; LibTorch's own
// kernel wherever ampx's does not apply.

#include "ampx/kernels.h"
#include "ampx/memory.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace {

// The same dtype, sizes and bytes (NaN payloads and signs of zero included).
::testing::AssertionResult same_bytes(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) {
    return ::testing::AssertionFailure()
           << a.scalar_type() << a.sizes() << " against " << b.scalar_type() << b.sizes();
  }
  const torch::Tensor ac = a.contiguous(), bc = b.contiguous();
  const auto* ap = static_cast<const unsigned char*>(ac.data_ptr());
  const auto* bp = static_cast<const unsigned char*>(bc.data_ptr());
  const size_t size = ac.element_size();
  for (int64_t i = 0; i < ac.numel(); ++i) {
    if (std::memcmp(ap + i * size, bp + i * size, size) != 0) {
      return ::testing::AssertionFailure() << "element " << i << ": " << ac.flatten()[i].item()
                                           << " against " << bc.flatten()[i].item();
    }
  }
  return ::testing::AssertionSuccess();
}

// A [sizes] input of `dtype` with what decides a pool's winner: few distinct
// values (ties, a ReLU's zeros), -0.0 beside 0.0, and where `specials`, NaN
// (two payloads), +-infinity and windows of nothing but -infinity.
torch::Tensor input(std::vector<int64_t> sizes, torch::ScalarType dtype, bool specials) {
  torch::manual_seed(7);
  auto x = torch::relu(torch::randint(-3, 4, sizes, torch::kFloat));
  x = torch::where(torch::rand(sizes) < 0.1, torch::full({}, -0.0f), x);
  if (specials) {
    const float inf = std::numeric_limits<float>::infinity();
    auto u = torch::rand(sizes);
    x = torch::where(u < 0.03, torch::full({}, std::nanf("")), x);
    x = torch::where((u >= 0.03) & (u < 0.05), torch::full({}, -std::nanf("1")), x);
    x = torch::where((u >= 0.05) & (u < 0.08), torch::full({}, inf), x);
    x = torch::where((u >= 0.08) & (u < 0.1), torch::full({}, -inf), x);
    x.flatten().narrow(0, 0, x.size(-1) * 4).fill_(-inf);  // whole windows of -inf
  }
  return x.to(dtype);
}

// The output and input gradient of `pool` on x under an upstream gradient
// that holds -0.0 (0 + -0 is +0 in LibTorch's backward).
std::vector<torch::Tensor> run(const std::function<torch::Tensor(const torch::Tensor&)>& pool,
                               const torch::Tensor& x) {
  auto leaf = x.detach().clone().requires_grad_(true);
  auto y = pool(leaf);
  torch::manual_seed(11);
  auto dy = torch::randn(y.sizes()).to(y.scalar_type());
  dy = torch::where(torch::rand(y.sizes()) < 0.2, torch::full({}, -0.0f).to(dy.scalar_type()), dy);
  y.backward(dy);
  return {y.detach(), leaf.grad()};
}

// Whether LibTorch pools float16 on the CPU (1.13 does not).
bool libtorch_pools_half() {
  try {
    torch::max_pool2d(torch::zeros({1, 1, 2, 2}, torch::kHalf), 2);
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

// LibTorch's max_pool2d; a float16 input, where LibTorch takes none, in
// float32 and back (every float16 value and its max are exact in float32).
torch::Tensor libtorch_pool(const torch::Tensor& t, at::IntArrayRef kernel,
                            at::IntArrayRef stride) {
  static const bool half = libtorch_pools_half();
  if (t.scalar_type() != torch::kHalf || half) return torch::max_pool2d(t, kernel, stride);
  return torch::max_pool2d(t.to(torch::kFloat), kernel, stride).to(torch::kHalf);
}

struct PoolCase {
  std::vector<int64_t> sizes, kernel, stride;
};

}  // namespace

TEST(MaxPool2dTest, MatchesLibTorchBitForBitForwardAndBackward) {
  const std::vector<PoolCase> cases = {
      {{16, 32, 28, 28}, {2}, {}},      // mnist-cnn's first pool (at batch 16)
      {{16, 64, 14, 14}, {2, 2}, {2}},  // and its second
      {{3, 5, 9, 7}, {2}, {}},          // a row and a column no window covers
      {{2, 4, 10, 11}, {3}, {3}},       // a 3 x 3 window
      {{2, 3, 8, 9}, {2, 3}, {}},       // a 2 x 3 one
      {{4, 7, 5}, {2}, {}},             // an unbatched [C, H, W] input
      {{2, 2, 4, 4}, {4}, {}},          // one window an image
  };
  for (const auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16, torch::kHalf}) {
    for (const bool specials : {false, true}) {
      for (const auto& c : cases) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + (specials ? " with NaN and inf" : "") +
                     " " + c10::str(c.sizes) + " kernel " + c10::str(c.kernel));
        const auto x = input(c.sizes, dtype, specials);
        ASSERT_TRUE(ampx::max_pool2d_is_fused(x, c.kernel, c.stride, {0}, {1}, false));
        const auto ours =
            run([&](const torch::Tensor& t) { return ampx::max_pool2d(t, c.kernel, c.stride); }, x);
        const auto aten =
            run([&](const torch::Tensor& t) { return libtorch_pool(t, c.kernel, c.stride); }, x);
        EXPECT_TRUE(same_bytes(ours[0], aten[0])) << "output";
        EXPECT_TRUE(same_bytes(ours[1], aten[1])) << "input gradient";
        // Without a graph: the same output, nothing kept.
        torch::NoGradGuard no_grad;
        const auto plain = ampx::max_pool2d(x.detach().requires_grad_(true), c.kernel, c.stride);
        EXPECT_FALSE(plain.requires_grad());
        EXPECT_TRUE(same_bytes(plain, aten[0]));
      }
    }
  }
}

TEST(MaxPool2dTest, LibTorchRunsWhatTheKernelDoesNotTake) {
  const auto x = input({2, 3, 8, 8}, torch::kFloat, true);
  struct Other {
    const char* what;
    torch::Tensor x;
    std::vector<int64_t> kernel, stride, padding, dilation;
    bool ceil_mode;
  };
  const std::vector<Other> others = {
      {"channels-last", x.contiguous(torch::MemoryFormat::ChannelsLast), {2}, {}, {0}, {1}, false},
      {"a transposed view", x.transpose(2, 3), {2}, {}, {0}, {1}, false},
      {"overlapping windows", x, {3}, {2}, {0}, {1}, false},
      {"padding", x, {2}, {}, {1}, {1}, false},
      {"dilation", x, {2}, {}, {0}, {2}, false},
      {"ceil_mode", x, {3}, {}, {0}, {1}, true},
      {"integers", torch::randint(0, 9, {2, 3, 8, 8}), {2}, {}, {0}, {1}, false},
  };
  for (const auto& o : others) {
    SCOPED_TRACE(o.what);
    EXPECT_FALSE(
        ampx::max_pool2d_is_fused(o.x, o.kernel, o.stride, o.padding, o.dilation, o.ceil_mode));
    if (!o.x.is_floating_point()) continue;  // LibTorch's CPU max_pool2d takes floating types only
    auto pool = [&](auto f) {
      return run(
          [&](const torch::Tensor& t) {
            return f(t, o.kernel, o.stride, o.padding, o.dilation, o.ceil_mode);
          },
          o.x);
    };
    const auto ours = pool([](auto&&... a) { return ampx::max_pool2d(a...); });
    const auto aten = pool([](auto&&... a) { return torch::max_pool2d(a...); });
    EXPECT_TRUE(same_bytes(ours[0], aten[0]));
    EXPECT_TRUE(same_bytes(ours[1], aten[1]));
  }
  // LibTorch's errors, as LibTorch words them: a window larger than the image.
  EXPECT_FALSE(ampx::max_pool2d_is_fused(x, {9}, {}, {0}, {1}, false));
  EXPECT_THROW(ampx::max_pool2d(x, {9}), c10::Error);
}

TEST(MaxPool2dTest, KeepsOneByteAnOutputForBackward) {
  // What a pool's graph holds until backward: its output and the winners'
  // places, one byte an output (LibTorch's: an int64 index an output).
  ampx::enable_cpu_memory_tracking();
  const auto x = input({8, 4, 6, 6}, torch::kFloat, false).requires_grad_(true);
  const int64_t outputs = 8 * 4 * 3 * 3;
  auto held = [&](auto pool) {
    const int64_t before = ampx::cpu_memory_stats().allocated_bytes;
    auto y = pool();
    return std::make_pair(ampx::cpu_memory_stats().allocated_bytes - before, y);
  };
  const auto [ours, y] = held([&] { return ampx::max_pool2d(x, 2); });
  EXPECT_EQ(ours, outputs * (4 + 1));
  const auto [aten, y_aten] = held([&] { return torch::max_pool2d(x, 2); });
  EXPECT_GE(aten, outputs * (4 + 8));
  EXPECT_TRUE(same_bytes(y, y_aten));
}

TEST(MaxPool2dTest, DifferentiatesItsGradientAsLibTorchDoes) {
  // A gradient penalty: backward with create_graph, then the gradient's
  // norm differentiated again, through the upstream gradient and the input.
  for (const auto dtype : {torch::kFloat, torch::kDouble}) {
    const auto x0 = input({2, 3, 6, 7}, dtype, false);
    auto penalty = [&](auto pool) {
      auto x = x0.clone().requires_grad_(true);
      auto y = pool(x);
      torch::manual_seed(3);
      auto dy = torch::randn(y.sizes(), y.options()).requires_grad_(true);
      auto dx =
          torch::autograd::grad({y}, {x}, {dy}, /*retain_graph=*/true, /*create_graph=*/true)[0];
      EXPECT_TRUE(dx.requires_grad());
      ((dx * dx).sum() + (y * y).sum()).backward();
      return std::vector<torch::Tensor>{dx.detach(), dy.grad(), x.grad()};
    };
    const auto ours = penalty([](const torch::Tensor& t) { return ampx::max_pool2d(t, 2); });
    const auto aten = penalty([](const torch::Tensor& t) { return torch::max_pool2d(t, 2); });
    for (size_t i = 0; i < ours.size(); ++i) EXPECT_TRUE(same_bytes(ours[i], aten[i])) << i;
  }
}
