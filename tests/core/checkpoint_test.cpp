// ampx::checkpoint: the gradients of a checkpointed function are those of the
// function run plainly, bit for bit (fp32, dropout, autocast, O2's region),
// while its graph keeps none of its activations; misuse is refused.

#include "ampx/checkpoint.h"

#include "../test_util.h"
#include "ampx/amp.h"
#include "ampx/autocast.h"
#include "ampx/fp8/autocast.h"
#include "ampx/kernels/cpu_products.h"
#include "ampx/memory.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <vector>

namespace {

using ::testing::HasSubstr;

// A pre-norm transformer MLP with dropout: what a model checkpoints.
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t d, double p = 0.0) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc = register_module("fc", torch::nn::Linear(d, 4 * d));
    out = register_module("out", torch::nn::Linear(4 * d, d));
    drop = register_module("drop", torch::nn::Dropout(p));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + drop(out(torch::gelu(fc(ln(x))))); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc{nullptr}, out{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Mlp);

// The gradients of every parameter, then of x.
std::vector<torch::Tensor> gradients(torch::nn::Module& m, const torch::Tensor& x) {
  std::vector<torch::Tensor> g;
  for (const auto& p : m.parameters()) g.push_back(p.grad().clone());
  g.push_back(x.grad().clone());
  return g;
}

void expect_same_bits(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(a[i].defined() && b[i].defined()) << i;
    EXPECT_EQ(a[i].scalar_type(), b[i].scalar_type()) << i;
    EXPECT_TRUE(torch::equal(a[i], b[i])) << "gradient " << i << " differs";
  }
}

// One step's gradients of `mlp` (seeded), plain or through ampx::checkpoint,
// with `region` alive over the forward only (nullptr: none).
std::vector<torch::Tensor> step(Mlp& mlp, bool checkpointed,
                                const std::function<std::shared_ptr<void>()>& region = nullptr,
                                c10::ScalarType input_dtype = torch::kFloat) {
  torch::manual_seed(5);
  mlp->zero_grad();
  auto x = torch::randn({8, 16, 32}).to(input_dtype).requires_grad_(true);
  torch::Tensor loss;
  {
    auto r = region ? region() : nullptr;
    auto y =
        checkpointed ? ampx::checkpoint([&](const torch::Tensor& h) { return mlp(h); }, x) : mlp(x);
    loss = y.to(torch::kFloat).pow(2).mean();
  }
  loss.backward();
  return gradients(*mlp, x);
}

TEST(CheckpointTest, GradientsAreThePlainOnesBitForBitInFloat32) {
  torch::manual_seed(0);
  Mlp mlp(32);
  expect_same_bits(step(mlp, true), step(mlp, false));
}

TEST(CheckpointTest, TheGraphKeepsOnlyTheInputsAndTheRandomState) {
  ampx::enable_cpu_memory_tracking();
  torch::manual_seed(0);
  Mlp mlp(64);
  const auto x = torch::randn({64, 64}).requires_grad_(true);
  auto kept = [&](bool checkpointed) {
    const auto before = ampx::cpu_memory_stats().allocated_bytes;
    auto y =
        checkpointed ? ampx::checkpoint([&](const torch::Tensor& h) { return mlp(h); }, x) : mlp(x);
    return ampx::cpu_memory_stats().allocated_bytes - before - y.nbytes();
  };
  const auto rng_bytes =
      static_cast<int64_t>(at::detail::getDefaultCPUGenerator().get_state().nbytes());
  // fc's input (the norm's output), GELU's input and output: 64 x (64 + 256 + 256) floats at least.
  EXPECT_GE(kept(false), 64 * (64 + 256 + 256) * 4);
  EXPECT_EQ(kept(true), rng_bytes);  // the saved CPU generator state, nothing else
}

TEST(CheckpointTest, DropoutDrawsTheForwardsNumbersAgain) {
  torch::manual_seed(0);
  Mlp mlp(32, /*p=*/0.5);
  auto plain = step(mlp, false);
  const auto next_plain = torch::rand({4});
  auto ckpt = step(mlp, true);
  const auto next_ckpt = torch::rand({4});
  expect_same_bits(ckpt, plain);
  // The generator goes on from where the forward left it.
  EXPECT_TRUE(torch::equal(next_plain, next_ckpt));
}

TEST(CheckpointTest, WithoutPreservedRandomStateDropoutDiffers) {
  torch::manual_seed(0);
  Mlp mlp(32, /*p=*/0.5);
  auto plain = step(mlp, false);
  torch::manual_seed(5);
  mlp->zero_grad();
  auto x = torch::randn({8, 16, 32}).requires_grad_(true);
  ampx::checkpoint([&](const torch::Tensor& h) { return mlp(h); }, x,
                   ampx::CheckpointOptions().preserve_rng_state(false))
      .pow(2)
      .mean()
      .backward();
  EXPECT_FALSE(torch::equal(mlp->fc->weight.grad(), plain[2]));  // other masks
}

TEST(CheckpointTest, RecomputesInsideTheForwardsAutocastRegion) {
  torch::manual_seed(0);
  Mlp mlp(32);
  auto autocast = [] { return std::make_shared<ampx::AutocastGuard>(torch::kCPU); };
  auto plain = step(mlp, false, autocast);
  expect_same_bits(step(mlp, true, autocast), plain);
  EXPECT_FALSE(ampx::is_autocast_enabled(torch::kCPU));
  // The products ran in bfloat16: not the float32 gradients.
  EXPECT_FALSE(torch::equal(step(mlp, false)[2], plain[2]));
}

TEST(CheckpointTest, ASharedWeightGetsBothGradientsInOneAutocastRegion) {
  // The checkpointed forward runs without a graph: its cast of an fp32 weight
  // must not stay in autocast's cache for a use of the same weight after it.
  torch::manual_seed(0);
  torch::nn::Linear lin(16, 16);
  auto run = [&](bool checkpointed) {
    lin->zero_grad();
    torch::manual_seed(1);
    auto x = torch::randn({4, 16}, torch::TensorOptions().requires_grad(true));
    torch::Tensor loss;
    {
      ampx::AutocastGuard autocast(torch::kCPU);
      auto h = checkpointed ? ampx::checkpoint([&](const torch::Tensor& t) { return lin(t); }, x)
                            : lin(x);
      loss = lin(h).to(torch::kFloat).sum();
    }
    loss.backward();
    return lin->weight.grad().clone();
  };
  const auto products = ampx::get_cpu_products();
  for (auto mode :
       {ampx::CpuProducts::kNative, ampx::CpuProducts::kWide}) {  // autocast's casts, ampx's
    ampx::set_cpu_products(mode);
    EXPECT_TRUE(torch::equal(run(true), run(false))) << static_cast<int>(mode);
  }
  ampx::set_cpu_products(products);
}

TEST(CheckpointTest, RecomputesInsideTheO2ForwardRegion) {
  torch::manual_seed(0);
  Mlp mlp(32);
  torch::optim::SGD opt(mlp->parameters(), 0.1);
  auto amp = ampx::initialize(mlp.ptr(), {&opt},
                              ampx::AmpOptions(ampx::OptLevel::O2).master_weights(false));
  ASSERT_EQ(mlp->fc->weight.scalar_type(), torch::kBFloat16);
  ASSERT_EQ(mlp->ln->weight.scalar_type(), torch::kFloat);  // kept fp32: the guard feeds it fp32
  struct Region {  // the session's forward region, alive as long as a shared_ptr
    explicit Region(const ampx::AmpSession& a) : guard(a.forward_guard()) {}
    ampx::ForwardGuard guard;
  };
  auto forward = [&] { return std::make_shared<Region>(amp); };
  auto plain = step(mlp, false, forward, torch::kBFloat16);
  expect_same_bits(step(mlp, true, forward, torch::kBFloat16), plain);
}

TEST(CheckpointTest, ManyInputsAndOutputsOneUnused) {
  torch::manual_seed(0);
  auto a = torch::randn({5, 3}, torch::requires_grad());
  auto b = torch::randn({3, 4}, torch::requires_grad());
  auto c = torch::randn({5, 4});  // no gradient
  auto fn = [](const std::vector<torch::Tensor>& in) {
    auto p = in[0].matmul(in[1]);
    return std::vector<torch::Tensor>{p.sin() * in[2], p.cos(), in[0]};
  };
  auto run = [&](bool checkpointed) {
    a.mutable_grad() = torch::Tensor();
    b.mutable_grad() = torch::Tensor();
    auto out = checkpointed ? ampx::checkpoint(fn, {a, b, c}) : fn({a, b, c});
    (out[0].sum() + out[2].pow(2).sum()).backward();  // out[1] unused
    return std::vector<torch::Tensor>{a.grad().clone(), b.grad().clone()};
  };
  expect_same_bits(run(true), run(false));
}

TEST(CheckpointTest, NestedCheckpointsRecomputeInsideEachOther) {
  torch::manual_seed(0);
  Mlp inner(16), outer(16);
  int runs = 0;
  auto model = [&](const torch::Tensor& x, bool checkpointed) {
    if (!checkpointed) return outer(inner(x));
    return ampx::checkpoint(
        [&](const torch::Tensor& h) {
          ++runs;
          return outer(ampx::checkpoint([&](const torch::Tensor& t) { return inner(t); }, h));
        },
        x);
  };
  auto grads = [&](bool checkpointed) {
    inner->zero_grad();
    outer->zero_grad();
    torch::manual_seed(3);
    auto x = torch::randn({4, 16}, torch::requires_grad());
    model(x, checkpointed).sum().backward();
    auto g = gradients(*inner, x);
    for (const auto& p : outer->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  expect_same_bits(grads(true), grads(false));
  EXPECT_EQ(runs, 2);  // the forward and backward's recompute
}

TEST(CheckpointTest, UnderNoGradItOnlyRuns) {
  torch::manual_seed(0);
  Mlp mlp(16);
  const auto x = torch::randn({4, 16}, torch::requires_grad());
  torch::NoGradGuard no_grad;
  const auto y = ampx::checkpoint([&](const torch::Tensor& h) { return mlp(h); }, x);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(torch::equal(y, mlp(x)));
}

TEST(CheckpointTest, RefusesAutogradGradAndAnInputChangedInPlace) {
  torch::manual_seed(0);
  Mlp mlp(16);
  auto x = torch::randn({4, 16}, torch::requires_grad());
  auto y = ampx::checkpoint([&](const torch::Tensor& h) { return mlp(h); }, x);
  EXPECT_THAT(ampx::test::error_text([&] { torch::autograd::grad({y.sum()}, {x}); }),
              HasSubstr("ampx::checkpoint: its gradients are accumulated by a backward inside "
                        "backward, so it works with backward() but not with "
                        "torch::autograd::grad()"));
  auto h = torch::randn({4, 16}, torch::requires_grad()) * 1;
  auto z = ampx::checkpoint([&](const torch::Tensor& t) { return mlp(t); }, h);
  h.add_(1);
  EXPECT_THAT(ampx::test::error_text([&] { z.sum().backward(); }),
              HasSubstr("modified by an inplace operation"));
}

TEST(CheckpointTest, RefusesBadArgumentsAndFp8Regions) {
  const auto x = torch::randn({2, 2}, torch::requires_grad());
  EXPECT_THAT(ampx::test::error_text([&] { ampx::checkpoint(ampx::CheckpointFunction(), {x}); }),
              HasSubstr("ampx::checkpoint: fn is empty"));
  EXPECT_THAT(ampx::test::error_text([&] {
                ampx::checkpoint([](const std::vector<torch::Tensor>& in) { return in; },
                                 {x, torch::Tensor()});
              }),
              HasSubstr("ampx::checkpoint: input 1 is an undefined tensor"));
  EXPECT_THAT(ampx::test::error_text([&] {
                ampx::checkpoint([](const torch::Tensor&) { return torch::Tensor(); }, x);
              }),
              HasSubstr("ampx::checkpoint: the function's output 0 is an undefined tensor"));
  ampx::fp8::Fp8AutocastGuard fp8;
  EXPECT_THAT(ampx::test::error_text(
                  [&] { ampx::checkpoint([](const torch::Tensor& t) { return t * 2; }, x); }),
              HasSubstr("ampx::checkpoint: refused inside an FP8 region (Fp8AutocastGuard)"));
}

}  // namespace
