// When an FP8 layer casts its weight (Fp8AutocastOptions::weight_casts):
// with gradient accumulation, kFirstMicroBatch and kLaterMicroBatch cast each
// weight once per optimizer step; under current scaling that gives exactly
// what casting at every forward gives, under delayed scaling the first
// micro-batch's codes (TE's is_first_microbatch), with the weight's amax
// recorded at every forward; a weight changed in place since is cast anew.

#include "ampx/fp8/linear.h"

#include "../test_util.h"
#include "ampx/dist.h"
#include "ampx/optim.h"

#include <torch/cuda.h>
#if defined(AMPX_TESTS_WITH_CUDA)
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <functional>
#include <vector>

namespace ampx {
namespace fp8 {
namespace {

struct NetImpl : torch::nn::Module {
  explicit NetImpl(const Recipe& recipe) {
    fc1 = register_module("fc1", Linear(LinearOptions(8, 32).recipe(recipe)));
    fc2 = register_module("fc2", Linear(LinearOptions(32, 1).recipe(recipe).output_dtype(
                                           torch::kFloat)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2->forward(torch::tanh(fc1->forward(x).to(torch::kFloat)));
  }
  Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

// What a run gives: every micro-batch's loss, the weights and every buffer
// (the scaling states) after it, and how many weight casts it made.
struct Run {
  std::vector<float> losses;
  std::vector<at::Tensor> params, buffers;
  int64_t casts = 0;
};

using MakeOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(Net&)>;

// Which WeightCasts a micro-batch's region has, by its index in the step.
using Schedule = std::function<WeightCasts(int)>;
const Schedule kEvery = [](int) { return WeightCasts::kEveryForward; };
const Schedule kMarked = [](int m) {
  return m == 0 ? WeightCasts::kFirstMicroBatch : WeightCasts::kLaterMicroBatch;
};
const Schedule kLaterOnly = [](int) { return WeightCasts::kLaterMicroBatch; };

// `steps` optimizer steps of `micro` micro-batches each, every micro-batch's
// forward in its own FP8 region as `schedule` says, the gradients accumulated.
Run accumulate(Net& net, const MakeOptimizer& make, const Schedule& schedule, int steps,
               int micro, const torch::Device& device = torch::kCPU) {
  auto opt = make(net);
  Run run;
  const int64_t before = detail::weight_casts();
  for (int step = 0; step < steps; ++step) {
    opt->zero_grad();
    for (int m = 0; m < micro; ++m) {
      const auto b = test::make_batch(step * micro + m, 16);
      at::Tensor loss;
      {
        Fp8AutocastGuard region(Fp8AutocastOptions().weight_casts(schedule(m)));
        loss = torch::mse_loss(net->forward(b.x.to(device)), b.y.to(device)) / micro;
      }
      loss.backward();
      run.losses.push_back(loss.item<float>());
    }
    opt->step();
  }
  run.casts = detail::weight_casts() - before;
  for (const auto& p : net->parameters()) run.params.push_back(p.detach().cpu().clone());
  for (const auto& b : net->buffers()) run.buffers.push_back(b.detach().cpu().clone());
  return run;
}

// Two copies of one net on `device`, trained alike but for `a` and `b`.
std::pair<Run, Run> both(const Recipe& recipe, const MakeOptimizer& make, const Schedule& a,
                         const Schedule& b, int steps, int micro,
                         const torch::Device& device = torch::kCPU) {
  torch::manual_seed(11);
  Net net_a(recipe), net_b(recipe);
  test::copy_params(*net_a, *net_b);
  net_a->to(device);
  net_b->to(device);
  return {accumulate(net_a, make, a, steps, micro, device),
          accumulate(net_b, make, b, steps, micro, device)};
}

const MakeOptimizer kTorchSgd = [](Net& net) -> std::unique_ptr<torch::optim::Optimizer> {
  return std::make_unique<torch::optim::SGD>(net->parameters(),
                                             torch::optim::SGDOptions(0.05).momentum(0.9));
};
const MakeOptimizer kAmpxAdamW = [](Net& net) -> std::unique_ptr<torch::optim::Optimizer> {
  return std::make_unique<optim::AdamW>(net->parameters(), optim::AdamWOptions(3e-3));
};

// Under current scaling a weight's cast depends on the weight alone: kept
// between the micro-batches of a step, made again at each step's first, and
// the run is kEveryForward's bit for bit, whatever the optimizer (LibTorch's
// SGD writes through .data(), which no version counter sees).
TEST(Fp8WeightCastsTest, CurrentScalingCastsEachWeightOncePerStepWithTheSameBits) {
  for (const auto& [name, make] : {std::pair<const char*, MakeOptimizer>{"torch SGD", kTorchSgd},
                                   {"ampx AdamW", kAmpxAdamW}}) {
    SCOPED_TRACE(name);
    const auto [every, kept] = both(CurrentScaling(), make, kEvery, kMarked, 4, 3);
    EXPECT_EQ(kept.casts, 2 * 4);  // two layers, four steps: not 2 * 4 * 3
    EXPECT_EQ(every.casts, 0);     // kEveryForward keeps (and counts) nothing
    EXPECT_EQ(kept.losses, every.losses);
    EXPECT_TRUE(test::same_bits(kept.params, every.params));
    EXPECT_TRUE(test::same_bits(kept.buffers, every.buffers));
    EXPECT_NE(every.losses.front(), every.losses.back());  // it trained
  }
}

// A kept cast is never given for a weight that has changed where its version
// counter shows it: ampx's optimizers count their writes, so even with no
// step's first micro-batch marked, every step casts anew, bit for bit.
TEST(Fp8WeightCastsTest, AWeightChangedInPlaceIsCastAnew) {
  const auto [every, kept] = both(CurrentScaling(), kAmpxAdamW, kEvery, kLaterOnly, 4, 3);
  EXPECT_EQ(kept.casts, 2 * 4);
  EXPECT_EQ(kept.losses, every.losses);
  EXPECT_TRUE(test::same_bits(kept.params, every.params));

  // A parameter replaced (not changed in place) is another tensor: cast too.
  torch::manual_seed(14);
  Linear fc(LinearOptions(16, 8).recipe(CurrentScaling()));
  const auto x = torch::randn({4, 16});
  const Fp8AutocastOptions later = Fp8AutocastOptions().weight_casts(WeightCasts::kLaterMicroBatch);
  at::Tensor y0, y1;
  {
    Fp8AutocastGuard region(later);
    y0 = fc->forward(x);
  }
  const int64_t before = detail::weight_casts();
  fc->weight = (fc->weight.detach() * 2).requires_grad_();  // the member forward() reads
  {
    Fp8AutocastGuard region(later);
    y1 = fc->forward(x);
  }
  EXPECT_EQ(detail::weight_casts() - before, 1);
  EXPECT_FALSE(torch::equal(y0, y1));
}

// An evaluation (no grad: nothing recorded, no scale moves) casts each weight
// once, however many batches it runs, with the codes a fresh cast gives; it
// leaves the scaling states alone. A no-grad kEveryForward forward beside it
// keeps what was kept.
TEST(Fp8WeightCastsTest, AnEvaluationCastsEachWeightOnce) {
  const Recipe recipe = DelayedScaling().amax_history_len(4);
  torch::manual_seed(12);
  Net net(recipe);
  accumulate(net, kTorchSgd, kEvery, 2, 1);  // scales off 1
  const auto states = test::snapshot(net->buffers());
  const int64_t before = detail::weight_casts();
  torch::NoGradGuard no_grad;
  for (int i = 0; i < 5; ++i) {
    const auto x = test::make_batch(100 + i, 16).x;
    at::Tensor fresh, reused;
    {
      Fp8AutocastGuard region(Fp8AutocastOptions().weight_casts(WeightCasts::kEveryForward));
      fresh = net->forward(x);
    }
    {
      Fp8AutocastGuard region(Fp8AutocastOptions().weight_casts(kMarked(i)));
      reused = net->forward(x);
    }
    EXPECT_TRUE(torch::equal(fresh, reused)) << i;
  }
  EXPECT_EQ(detail::weight_casts() - before, 2);  // the first batch's, one per layer
  EXPECT_TRUE(test::same_bits(test::snapshot(net->buffers()), states));
}

// Under c10::InferenceMode nothing is kept (its codes could not be saved by
// a later training backward) and nothing kept is given.
TEST(Fp8WeightCastsTest, InferenceModeNeitherKeepsNorGives) {
  torch::manual_seed(16);
  Net net{Recipe(CurrentScaling())};
  const auto x = test::make_batch(0, 16).x;
  const int64_t before = detail::weight_casts();
  {
    c10::InferenceMode inference;
    Fp8AutocastGuard region(Fp8AutocastOptions().weight_casts(WeightCasts::kFirstMicroBatch));
    net->forward(x);
  }
  EXPECT_EQ(detail::weight_casts() - before, 0);
  {
    Fp8AutocastGuard region(Fp8AutocastOptions().weight_casts(WeightCasts::kLaterMicroBatch));
    net->forward(x).sum().backward();  // casts and keeps: nothing was kept
  }
  EXPECT_EQ(detail::weight_casts() - before, 2);
}

// A weight moved away and back by set_data (module.to() there and back) may
// land at its old address with its old version counter: its storage tells.
// Made certain here by giving the weight a new storage over the same bytes,
// written meanwhile through a raw pointer (a write no counter sees).
TEST(Fp8WeightCastsTest, AWeightGivenANewStorageIsCastAnew) {
  torch::manual_seed(17);
  Linear fc(LinearOptions(16, 8).recipe(CurrentScaling()));
  const auto x = torch::randn({4, 16});
  const Fp8AutocastOptions later = Fp8AutocastOptions().weight_casts(WeightCasts::kLaterMicroBatch);
  const auto forward = [&](const Fp8AutocastOptions& options) {
    Fp8AutocastGuard region(options);
    return fc->forward(x);
  };
  forward(later);
  fc->to(torch::kBFloat16);  // rounds the weight
  fc->to(torch::kFloat);
  int64_t before = detail::weight_casts();
  at::Tensor kept = forward(later);
  EXPECT_EQ(detail::weight_casts() - before, 1);
  EXPECT_TRUE(torch::equal(kept, forward(Fp8AutocastOptions())));

  const at::Tensor bytes = fc->weight.detach().clone();
  fc->weight.set_data(bytes);
  forward(later);  // kept: the codes of `bytes`
  float* raw = bytes.data_ptr<float>();  // a write no version counter sees
  for (int64_t i = 0; i < bytes.numel(); ++i) raw[i] = 2 * raw[i] + 1;
  fc->weight.set_data(torch::from_blob(bytes.data_ptr(), bytes.sizes(), bytes.options()));
  before = detail::weight_casts();
  kept = forward(later);
  EXPECT_EQ(detail::weight_casts() - before, 1);
  EXPECT_TRUE(torch::equal(kept, forward(Fp8AutocastOptions())));
}

// Under delayed scaling a step's later micro-batches multiply by the codes
// its first one cast, at the scale that one had, while the weight's amax
// still enters the history at every forward.
TEST(Fp8WeightCastsTest, DelayedScalingKeepsTheFirstMicroBatchsCodesAndRecordsEveryAmax) {
  torch::manual_seed(13);
  Linear fc(LinearOptions(16, 8).recipe(DelayedScaling().amax_history_len(4)));
  // The first cast uses the initial scale, 1; the ones after it, 448 / amax.
  const auto ws = fc->weight_state().scale().clone();
  const auto wsi = fc->weight_state().scale_inv().clone();
  const auto w = fc->weight.detach();
  const auto wq = dequantize(quantize(w, Fp8Format::kE4M3, ws), Fp8Format::kE4M3, wsi, at::kFloat);
  const int64_t before = detail::weight_casts();
  for (int m = 0; m < 3; ++m) {
    const auto x = torch::randn({4, 16});
    const auto xs = fc->input_state().scale().clone();
    const auto xsi = fc->input_state().scale_inv().clone();
    at::Tensor y;
    {
      Fp8AutocastGuard fp8(Fp8AutocastOptions().weight_casts(kMarked(m)));
      y = fc->forward(x);
    }
    y.to(torch::kFloat).sum().backward();
    const auto xq =
        dequantize(quantize(x, Fp8Format::kE4M3, xs), Fp8Format::kE4M3, xsi, at::kFloat);
    const auto want = (xq.mm(wq.t()) + fc->bias.detach()).to(torch::kBFloat16);
    EXPECT_TRUE(torch::equal(y, want)) << "micro-batch " << m;
    if (m > 0) {
      EXPECT_FALSE(torch::equal(fc->weight_state().scale(), ws));  // the scale moved on
    }
  }
  EXPECT_EQ(detail::weight_casts() - before, 1);
  // The history holds the weight's amax three times, one per micro-batch.
  const auto history = fc->weight_state().amax_history();
  EXPECT_EQ(history.eq(w.abs().max()).sum().item<int64_t>(), 3);
  EXPECT_EQ(history.eq(0).sum().item<int64_t>(), 1);

  // An in-place change of the weight (here by hand; an optimizer's step is
  // one too) ends the kept cast: the next forward casts at the newest scale.
  {
    torch::NoGradGuard no_grad;
    fc->weight.mul_(0.5);
  }
  const auto ws2 = fc->weight_state().scale().clone();
  const auto wsi2 = fc->weight_state().scale_inv().clone();
  const auto x = torch::randn({4, 16});
  const auto xs = fc->input_state().scale().clone();
  const auto xsi = fc->input_state().scale_inv().clone();
  at::Tensor y;
  {
    Fp8AutocastGuard fp8(Fp8AutocastOptions().weight_casts(WeightCasts::kLaterMicroBatch));
    y = fc->forward(x);
  }
  EXPECT_EQ(detail::weight_casts() - before, 2);
  const auto wq2 = dequantize(quantize(fc->weight.detach(), Fp8Format::kE4M3, ws2),
                              Fp8Format::kE4M3, wsi2, at::kFloat);
  const auto xq = dequantize(quantize(x, Fp8Format::kE4M3, xs), Fp8Format::kE4M3, xsi, at::kFloat);
  EXPECT_TRUE(torch::equal(y, (xq.mm(wq2.t()) + fc->bias.detach()).to(torch::kBFloat16)));
}

// Under delayed scaling, casting once per step trains as casting at every
// forward does (its codes are at most a step's scale behind).
TEST(Fp8WeightCastsTest, DelayedScalingCastOncePerStepTrainsAsEveryForwardDoes) {
  const Recipe recipe = DelayedScaling().amax_history_len(16);
  const auto [every, once] = both(recipe, kTorchSgd, kEvery, kMarked, 40, 4);
  EXPECT_EQ(once.casts, 2 * 40);
  EXPECT_NE(once.losses, every.losses);  // other codes after the first micro-batch
  auto tail = [](const std::vector<float>& v) {
    double s = 0;
    for (size_t i = v.size() - 20; i < v.size(); ++i) s += v[i];
    return s / 20;
  };
  EXPECT_LT(tail(once.losses), 0.5 * (once.losses[0] + once.losses[1] + once.losses[2] +
                                      once.losses[3]));  // it learns
  EXPECT_NEAR(tail(once.losses), tail(every.losses), 0.05 * tail(every.losses));
}

// An amax reduction group is delayed scaling's: a current-scaling layer
// refuses one by name, whether its weight's cast is kept or not.
TEST(Fp8WeightCastsTest, CurrentScalingRefusesAnAmaxReductionGroupEitherWay) {
  if (!dist::is_available()) GTEST_SKIP() << "ampx built without c10d/Gloo";
  dist::LaunchEnv env;
  env.master_addr = "127.0.0.1";
  env.master_port = dist::free_loopback_port();
  const auto group = dist::init_process_group(
      env, dist::InitOptions().timeout(std::chrono::seconds(60)).nccl(false));
  Linear fc(LinearOptions(16, 8).recipe(CurrentScaling()));
  TensorScaling& weight = *fc->scaling().weight;
  for (const WeightCasts casts : {WeightCasts::kEveryForward, WeightCasts::kFirstMicroBatch,
                                  WeightCasts::kLaterMicroBatch}) {
    try {
      (void)weight.cast_weight(fc->weight, casts, /*record=*/true, &group);
      ADD_FAILURE() << "no error under WeightCasts " << static_cast<int>(casts);
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr("an amax_reduction_group applies to delayed "
                                                 "scaling; this layer's recipe is current"));
    }
  }
}

// On CUDA the kept codes and their transpose (the backward's operand) give
// kEveryForward's run bit for bit, and a later micro-batch's step never
// waits for the device (LibTorch's sync debug mode set to error).
TEST(Fp8WeightCastsTest, CudaKeptCastsGiveEveryForwardsBitsWithoutWaiting) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "CUDA not available";
#if defined(AMPX_TESTS_WITH_CUDA)
  for (const Recipe& recipe : {Recipe(CurrentScaling()), Recipe(DelayedScaling())}) {
    SCOPED_TRACE(recipe.to_string());
    const Schedule first_only = [](int m) {
      return m == 0 ? WeightCasts::kFirstMicroBatch : WeightCasts::kEveryForward;
    };
    // Delayed scaling: the same bits where every micro-batch is a first one.
    const Schedule kept = recipe.is_delayed() ? first_only : kMarked;
    const auto [every, mine] = both(recipe, kAmpxAdamW, kEvery, kept, 3, 3, torch::kCUDA);
    EXPECT_EQ(mine.losses, every.losses);
    EXPECT_TRUE(test::same_bits(mine.params, every.params));
    EXPECT_TRUE(test::same_bits(mine.buffers, every.buffers));
  }
  torch::manual_seed(15);
  Linear fc(LinearOptions(64, 32).recipe(DelayedScaling().amax_history_len(16)));
  fc->to(torch::kCUDA);
  const auto x = torch::randn({48, 64}, torch::kCUDA);
  const auto step = [&](WeightCasts casts) {
    at::Tensor y;
    {
      Fp8AutocastGuard fp8(Fp8AutocastOptions().weight_casts(casts));
      y = fc->forward(x);
    }
    y.to(torch::kFloat).sum().backward();
  };
  step(WeightCasts::kFirstMicroBatch);  // LibTorch's lazy set-ups, and the cast kept
  const int64_t before = detail::weight_casts();
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  try {
    for (int m = 0; m < 2; ++m) step(WeightCasts::kLaterMicroBatch);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "a later micro-batch synchronised: " << e.what();
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  EXPECT_EQ(detail::weight_casts() - before, 0);
#else
  GTEST_SKIP() << "ampx_tests built without CUDA";
#endif
}

// A block-scaled layer given its weight's quantizations from elsewhere (a
// sharding wrapper's gathered codes and scales) multiplies them instead of
// quantizing its weight: given those of another weight, its output and
// input gradient are the other weight's layer's bit for bit (the weight
// gradient, of x and the output gradient, its own); given its own, nothing
// changes; dropped, it quantizes its weight again. Quantizations of another
// shape or in other formats than the recipe's are refused, naming both, and
// BlockTensor::quantize takes a whole amax for NVFP4 alone.
TEST(Fp8WeightCastsTest, AGivenBlockWeightIsMultipliedInsteadOfTheWeight) {
  const Recipe recipe = MXFP8BlockScaling();
  torch::manual_seed(21);
  Linear fc(LinearOptions(64, 32).bias(false).recipe(recipe));
  Linear other(LinearOptions(64, 32).bias(false).recipe(recipe));
  const auto x = torch::randn({16, 64});
  const auto g = torch::randn({16, 32});
  struct Pass {
    at::Tensor y, grad_x, grad_w;
  };
  const auto pass = [&](Linear& layer) {
    const auto xi = x.clone().requires_grad_();
    layer->zero_grad();
    Pass p;
    {
      Fp8AutocastGuard region;
      p.y = layer->forward(xi);
    }
    p.y.backward(g);
    p.grad_x = xi.grad();
    p.grad_w = layer->weight.grad().clone();
    return p;
  };
  const auto formats = block_weight_formats(recipe);
  const auto give = [&](const at::Tensor& from) {
    const auto w = from.detach();
    fc->scaling().give_block_weight(fc->weight, BlockTensor::quantize(w, formats.forward),
                                    BlockTensor::quantize(w, formats.backward));
  };
  const Pass own = pass(fc), theirs = pass(other);
  give(other->weight);
  ASSERT_NE(fc->scaling().given_block_weight(fc->weight), nullptr);
  EXPECT_EQ(fc->scaling().given_block_weight(other->weight), nullptr);
  const Pass given = pass(fc);
  EXPECT_TRUE(torch::equal(given.y, theirs.y));
  EXPECT_TRUE(torch::equal(given.grad_x, theirs.grad_x));
  EXPECT_TRUE(torch::equal(given.grad_w, own.grad_w));
  EXPECT_FALSE(torch::equal(given.y, own.y));
  give(fc->weight);
  EXPECT_TRUE(torch::equal(pass(fc).y, own.y));
  fc->scaling().drop_given_block_weight();
  EXPECT_EQ(fc->scaling().given_block_weight(fc->weight), nullptr);
  EXPECT_TRUE(torch::equal(pass(fc).grad_x, own.grad_x));

  const auto w = fc->weight.detach();
  EXPECT_THAT(test::error_text([&] {
                fc->scaling().give_block_weight(fc->weight,
                                                BlockTensor::quantize(w, formats.forward),
                                                BlockTensor::quantize(w, formats.forward));
              }),
              ::testing::HasSubstr("quantizes its weight in e4m3/rceil/1x32 and "
                                   "e4m3/rceil/32x1, got e4m3/rceil/1x32 and e4m3/rceil/1x32"));
  const auto half = w.narrow(0, 0, 16);
  EXPECT_THAT(test::error_text([&] {
                fc->scaling().give_block_weight(fc->weight,
                                                BlockTensor::quantize(half, formats.forward),
                                                BlockTensor::quantize(half, formats.backward));
              }),
              ::testing::HasSubstr("codes of the weight's shape [32, 64] expected, got [16, 64]"));
  EXPECT_EQ(fc->scaling().given_block_weight(fc->weight), nullptr);
  EXPECT_THAT(test::error_text([&] {
                (void)BlockTensor::quantize(w, BlockFormat::mxfp8(), c10::nullopt, 1.0f);
              }),
              ::testing::HasSubstr("global_amax is NVFP4's alone"));
}

}  // namespace
}  // namespace fp8
}  // namespace ampx
