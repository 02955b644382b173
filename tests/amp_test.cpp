// initialize() and the opt levels: Apex's table, overrides, casting, misuse.

#include "ampx/amp.h"
#include "ampx/detail/compat.h"
#include "ampx/kernels.h"

#include "ampx/autocast.h"
#include "ampx/optim.h"
#include "test_util.h"

#include <ATen/Context.h>
#include <torch/torch.h>

#include <limits>

namespace {

using ::testing::HasSubstr;

using ampx::AmpOptions;
using ampx::LossScale;
using ampx::OptLevel;
using ampx::test::error_text;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    bn = register_module("bn", torch::nn::BatchNorm1d(16));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    fc2 = register_module("fc2", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(ln(bn(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::nn::LayerNorm ln{nullptr};
};
TORCH_MODULE(Net);

TEST(AmpTest, ParsesOptLevelsAndRejectsUnknownOnes) {
  EXPECT_EQ(ampx::parse_opt_level("O0"), OptLevel::O0);
  EXPECT_EQ(ampx::parse_opt_level("O3"), OptLevel::O3);
  EXPECT_EQ(ampx::to_string(OptLevel::O2), "O2");
  EXPECT_EQ(error_text([] { ampx::parse_opt_level("O5"); }),
            "parse_opt_level: unknown opt level 'O5'; expected O0, O1, O2 or O3 (capital letter "
            "O, as in Apex)");
  EXPECT_NE(error_text([] { ampx::parse_opt_level("o1"); }), "");
}

TEST(AmpTest, LevelsResolveToApexTable) {
  struct Row {
    OptLevel level;
    bool cast, patch, keep_bn, master;
  };
  for (const auto& r :
       {Row{OptLevel::O0, false, false, false, false}, Row{OptLevel::O1, false, true, false, false},
        Row{OptLevel::O2, true, false, true, false},
        Row{OptLevel::O3, true, false, false, false}}) {
    Net net;
    torch::optim::SGD opt(net->parameters(), 0.1);
    // torch::optim SGD cannot hold masters: O2 here overrides master_weights off.
    auto options = AmpOptions(r.level);
    if (r.level == OptLevel::O2) options.master_weights(false);
    auto amp = ampx::initialize(net.ptr(), {&opt}, options);
    const auto& p = amp.properties();
    EXPECT_EQ(p.dtype, torch::kBFloat16);  // the CPU default
    EXPECT_EQ(p.cast_model_type, r.cast) << ampx::to_string(r.level);
    EXPECT_EQ(p.patch_torch_functions, r.patch) << ampx::to_string(r.level);
    EXPECT_EQ(p.keep_batchnorm_fp32, r.keep_bn) << ampx::to_string(r.level);
    EXPECT_EQ(p.master_weights, r.master) << ampx::to_string(r.level);
    EXPECT_FALSE(p.loss_scale.has_value()) << "bf16 needs no loss scaling";
    EXPECT_FALSE(amp.scaler().is_enabled());
    EXPECT_THAT(p.to_string(), HasSubstr("opt_level               " + ampx::to_string(r.level)));
  }
}

TEST(AmpTest, Fp16ScalesDynamicallyAtO1AndO2Only) {
  for (auto level : {OptLevel::O0, OptLevel::O2, OptLevel::O3}) {  // O1 fp16: CPU 2.x only
    Net net;
    auto amp = ampx::initialize(
        net.ptr(), {},
        AmpOptions(level)
            .dtype(torch::kHalf)
            .master_weights(level == OptLevel::O2 ? c10::optional<bool>(false) : c10::nullopt));
    EXPECT_EQ(amp.scaler().is_enabled(), level == OptLevel::O2) << ampx::to_string(level);
    EXPECT_EQ(amp.properties().loss_scale.has_value(), level == OptLevel::O2);
  }
}

TEST(AmpTest, Bf16TurnsLossScalingOffUnlessForced) {
  Net a, b;
  auto amp_a = ampx::initialize(a.ptr(), {}, AmpOptions(OptLevel::O1));  // CPU: bf16
  EXPECT_EQ(amp_a.properties().dtype, torch::kBFloat16);
  EXPECT_FALSE(amp_a.scaler().is_enabled());
  auto amp_b =
      ampx::initialize(b.ptr(), {}, AmpOptions(OptLevel::O1).loss_scale(LossScale::dynamic()));
  EXPECT_TRUE(amp_b.scaler().is_enabled());
  EXPECT_EQ(amp_b.scaler().get_max_scale().value(), 16777216.0);
}

TEST(AmpTest, AllowTf32SetsLibTorchsSwitchesAndUnsetLeavesThem) {
  auto& ctx = at::globalContext();
  const bool matmul = ctx.allowTF32CuBLAS(), conv = ctx.allowTF32CuDNN();
  for (bool on : {true, false}) {
    Net net;
    auto amp = ampx::initialize(net.ptr(), {}, AmpOptions(OptLevel::O1).allow_tf32(on));
    EXPECT_EQ(ctx.allowTF32CuBLAS(), on);
    EXPECT_EQ(ctx.allowTF32CuDNN(), on);
    EXPECT_EQ(amp.properties().tf32_matmul, on);
    EXPECT_EQ(amp.properties().tf32_conv, on);
  }
  ctx.setAllowTF32CuBLAS(true);
  ctx.setAllowTF32CuDNN(false);
  Net net;
  auto amp = ampx::initialize(net.ptr(), {}, AmpOptions(OptLevel::O1));
  EXPECT_TRUE(ctx.allowTF32CuBLAS());
  EXPECT_FALSE(ctx.allowTF32CuDNN());
  EXPECT_TRUE(amp.properties().tf32_matmul);
  EXPECT_FALSE(amp.properties().tf32_conv);
  ctx.setAllowTF32CuBLAS(matmul);
  ctx.setAllowTF32CuDNN(conv);
}

TEST(AmpTest, O2CastsEverythingButNormLayers) {
  Net net;
  auto amp = ampx::initialize(net.ptr(), {}, AmpOptions(OptLevel::O2).master_weights(false));
  EXPECT_EQ(net->fc1->weight.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(net->fc2->bias.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(net->bn->weight.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->bn->running_mean.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->ln->weight.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->bn->num_batches_tracked.scalar_type(), torch::kLong);  // not floating
  EXPECT_EQ(amp.cast_input(torch::ones({2, 8})).scalar_type(), torch::kBFloat16);
  EXPECT_EQ(amp.cast_input(torch::ones({2}, torch::kLong)).scalar_type(), torch::kLong);
}

TEST(AmpTest, O3CastsEverythingAndO0CastsBackToFp32) {
  Net net;
  ampx::initialize(net.ptr(), {}, AmpOptions(OptLevel::O3));
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(net->bn->running_var.scalar_type(), torch::kBFloat16);
  Net other;
  other->to(torch::kBFloat16);
  ampx::initialize(other.ptr(), {}, AmpOptions(OptLevel::O0));
  for (const auto& p : other->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
}

TEST(AmpTest, O1ForwardGuardIsAutocastAndO0IsNothing) {
  Net a, b;
  auto o1 = ampx::initialize(a.ptr(), {}, AmpOptions(OptLevel::O1));
  auto o0 = ampx::initialize(b.ptr(), {}, AmpOptions(OptLevel::O0));
  a->eval();
  {
    auto forward = o1.forward_guard();
    EXPECT_TRUE(ampx::is_autocast_enabled(torch::kCPU));
    EXPECT_EQ(a->fc1->forward(torch::ones({2, 8})).scalar_type(), torch::kBFloat16);
  }
  EXPECT_FALSE(ampx::is_autocast_enabled(torch::kCPU));
  {
    auto forward = o0.forward_guard();
    EXPECT_FALSE(ampx::is_autocast_enabled(torch::kCPU));
  }
}

TEST(AmpTest, O2ForwardGuardRoutesNormsOnlyWhenTheModelHasThem) {
  Net with_norms;  // BatchNorm + LayerNorm, kept fp32
  auto o2 = ampx::initialize(with_norms.ptr(), {}, AmpOptions(OptLevel::O2));
  EXPECT_TRUE(o2.properties().has_fp32_norm_layers);
  {
    auto forward = o2.forward_guard();  // the norms-only region needs the Autocast key
    EXPECT_TRUE(ampx::is_autocast_enabled(torch::kCPU));
  }
  auto mlp =
      torch::nn::Sequential(torch::nn::Linear(8, 4), torch::nn::ReLU(), torch::nn::Linear(4, 2));
  auto plain = ampx::initialize(mlp.ptr(), {}, AmpOptions(OptLevel::O2));
  EXPECT_FALSE(plain.properties().has_fp32_norm_layers);
  const auto products = ampx::get_cpu_products();
  ampx::set_cpu_products(ampx::CpuProducts::kNative);
  {
    // Nothing to route but 16-bit attention, which LibTorch 2.1+ has
    // (at::scaled_dot_product_attention to ampx's kernel): autocast is on
    // there for that alone, and off on 1.13 (no registrations at all).
    auto forward = plain.forward_guard();
    EXPECT_EQ(ampx::is_autocast_enabled(torch::kCPU), AMPX_TORCH_AT_LEAST(2, 1));
    auto y = mlp->forward(plain.cast_input(torch::ones({3, 8})));
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  }
  // Products through the float32 BLAS (a CPU without AVX-512): the linears
  // are routed, so autocast is on for them.
  ampx::set_cpu_products(ampx::CpuProducts::kWide);
  {
    auto forward = plain.forward_guard();
    EXPECT_TRUE(ampx::is_autocast_enabled(torch::kCPU));
    auto y = mlp->forward(plain.cast_input(torch::ones({3, 8})));
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  }
  ampx::set_cpu_products(products);
}

TEST(AmpTest, MisuseIsAClearError) {
  Net net;
  torch::optim::Adam opt(net->parameters(), 0.01);
  ampx::initialize(net.ptr(), {&opt}, AmpOptions(OptLevel::O1));
  auto text = error_text([&] { ampx::initialize(net.ptr(), {&opt}, AmpOptions(OptLevel::O1)); });
  EXPECT_THAT(text, HasSubstr("was already initialized"));

  Net trained;
  torch::optim::Adam stepped(trained->parameters(), 0.01);
  trained->forward(torch::ones({4, 8})).sum().backward();
  stepped.step();
  text = error_text([&] { ampx::initialize(trained.ptr(), {&stepped}, AmpOptions(OptLevel::O3)); });
  EXPECT_THAT(text, HasSubstr("optimizers[0] already holds state for 8 parameters"));
  EXPECT_EQ(trained->fc1->weight.scalar_type(), torch::kFloat) << "a refused call casts nothing";

  Net other;
  text = error_text(
      [&] { ampx::initialize(other.ptr(), {}, AmpOptions(OptLevel::O1).master_weights(true)); });
  EXPECT_THAT(text, HasSubstr("master_weights only apply when the model is cast"));
  text = error_text(
      [&] { ampx::initialize(other.ptr(), {}, AmpOptions(OptLevel::O0).dtype(torch::kFloat)); });
  EXPECT_THAT(text, HasSubstr("dtype must be float16 or bfloat16, got Float"));
}

TEST(AmpTest, FixedLossScaleNeverChangesButStillSkipsOverflow) {
  // (No norm layers: LibTorch 1.13's CPU autocast cannot feed a bf16 tensor
  // into LayerNorm's fp32 weights; Python 1.13 fails the same way.)
  torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 1));
  // Momentum: the skipped step finds momentum buffers it must leave alone.
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto amp = ampx::initialize(net.ptr(), {&opt},
                              AmpOptions(OptLevel::O1).loss_scale(LossScale::fixed(128.0)));
  auto& scaler = amp.scaler();
  for (int step = 0; step < 4; ++step) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      auto forward = amp.forward_guard();
      loss = net->forward(torch::ones({4, 8})).to(torch::kFloat).pow(2).mean();
    }
    scaler.scale(loss).backward();
    if (step == 2)
      net->parameters()[0].mutable_grad()[0][0] = std::numeric_limits<float>::infinity();
    const auto before = ampx::test::training_state(*net, {&opt});
    EXPECT_EQ(scaler.step(opt).stepped(), step != 2);
    if (step == 2) ampx::test::expect_unchanged(before, ampx::test::training_state(*net, {&opt}));
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 128.0);
  }
}

TEST(AmpTest, OneScalerPerLossAndStateDictKeys) {
  Net net;
  auto amp = ampx::initialize(net.ptr(), {},
                              AmpOptions(OptLevel::O1)
                                  .dtype(torch::kBFloat16)
                                  .loss_scale(LossScale::dynamic())
                                  .num_losses(2));
  EXPECT_NE(&amp.scaler(0), &amp.scaler(1));
  EXPECT_THAT(error_text([&] { amp.scaler(2); }),
              HasSubstr("loss_id must be in [0, num_losses=2)"));
  auto state = amp.state_dict();
  ASSERT_EQ(state.size(), 2u);
  EXPECT_EQ(state.at("loss_scaler1").at("scale").toDouble(), 65536.0);
  state["loss_scaler1"]["scale"] = 8.0;
  amp.load_state_dict(state);
  EXPECT_EQ(amp.scaler(1).get_scale(), 8.0);
  state["loss_scaler0"].erase("growth_factor");
  EXPECT_NE(error_text([&] { amp.load_state_dict(state); }), "");
  EXPECT_EQ(amp.scaler(1).get_scale(), 8.0);
}

// ---- O2/O3 end to end: master weights in ampx::optim, norms fed in fp32

struct Data {
  torch::Tensor x, y;
};

Data regression_data() {
  auto g = at::detail::createCPUGenerator(42);
  auto x = at::randn({256, 8}, g);
  auto y = (x.slice(1, 0, 4).sum(1, true) - x.slice(1, 4, 8).pow(2).mean(1, true)).tanh();
  return {x, y};
}

// The loss of predicting 0 (the data's scale), for "it learned" checks.
double regression_loss_at_start() {
  const auto data = regression_data();
  return data.y.pow(2).mean().item<double>();
}

double train(Net& net, torch::optim::Optimizer& opt, ampx::AmpSession* amp, int steps) {
  const auto data = regression_data();
  double loss_value = 0;
  for (int step = 0; step < steps; ++step) {
    const auto x = data.x.slice(0, (step % 4) * 64, (step % 4 + 1) * 64);
    const auto y = data.y.slice(0, (step % 4) * 64, (step % 4 + 1) * 64);
    opt.zero_grad();
    torch::Tensor loss;
    if (amp) {
      auto forward = amp->forward_guard();
      loss = torch::mse_loss(amp->cast_output(net->forward(amp->cast_input(x))), y);
      amp->scaler().scale(loss).backward();
      amp->scaler().step(opt);
      amp->scaler().update();
    } else {
      loss = torch::mse_loss(net->forward(x), y);
      loss.backward();
      opt.step();
    }
    loss_value = loss.item<double>();
  }
  return loss_value;
}

TEST(AmpTest, O2TrainsWithFp32MastersAndFp32NormsLikeFp32) {
  torch::manual_seed(0);
  Net ref, net;
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < ref->parameters().size(); ++i)
      net->parameters()[i].copy_(ref->parameters()[i]);
  }
  const auto fc1_fp32 = net->fc1->weight.detach().clone();
  ampx::optim::AdamW ref_opt(ref->parameters(), ampx::optim::AdamWOptions(3e-3));
  ampx::optim::AdamW opt(net->parameters(), ampx::optim::AdamWOptions(3e-3));
  auto amp = ampx::initialize(net.ptr(), {&opt},
                              AmpOptions(OptLevel::O2).cast_model_outputs(torch::kFloat));
  EXPECT_TRUE(amp.properties().master_weights);
  EXPECT_EQ(net->fc1->weight.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(net->ln->weight.scalar_type(), torch::kFloat);
  const double ref_loss = train(ref, ref_opt, nullptr, 150);
  const double loss = train(net, opt, &amp, 150);
  // The master started from the fp32 value, not its bf16 rounding.
  EXPECT_EQ(net->fc1->weight.scalar_type(), torch::kBFloat16);
  const auto master = opt.master(net->fc1->weight);
  ASSERT_TRUE(master.defined());
  EXPECT_EQ(master.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(master.to(torch::kBFloat16), net->fc1->weight.detach()));
  EXPECT_FALSE(torch::equal(master, fc1_fp32)) << "the masters must have trained";
  EXPECT_LT(loss, 0.5 * regression_loss_at_start()) << "O2 must learn";
  EXPECT_NEAR(loss, ref_loss, 0.1 * ref_loss + 2e-3) << "O2 within 10% of fp32";
}

// A skipped O2 step (bf16 model, fp32 masters, forced dynamic loss scaling)
// changes no weight, master, moment, step count or BatchNorm running stat.
TEST(AmpTest, O2SkippedStepLeavesWeightsMastersMomentsAndBuffersBitwise) {
  torch::manual_seed(0);
  Net net;
  ampx::optim::AdamW opt(net->parameters(), ampx::optim::AdamWOptions(3e-3));
  auto amp = ampx::initialize(
      net.ptr(), {&opt},
      AmpOptions(OptLevel::O2).loss_scale(LossScale::dynamic()).cast_model_outputs(torch::kFloat));
  const auto data = regression_data();
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      auto forward = amp.forward_guard();
      loss = torch::mse_loss(amp.cast_output(net->forward(amp.cast_input(data.x))), data.y);
    }
    amp.scaler().scale(loss).backward();
    const bool poison = step == 2;
    if (poison) {
      net->fc1->weight.mutable_grad().view(-1)[3] = std::numeric_limits<float>::infinity();
    }
    const auto before = ampx::test::training_state(*net, {&opt});
    EXPECT_EQ(amp.scaler().step(opt).stepped(), !poison);
    if (poison) {
      ampx::test::expect_unchanged(before, ampx::test::training_state(*net, {&opt}));
      EXPECT_EQ(opt.step_count(net->fc1->weight), 2);
    }
    amp.scaler().update();
  }
  EXPECT_EQ(amp.scaler().get_scale(), 32768.0);
}

TEST(AmpTest, O2RefusesTorchOptimizersAndO3RefusesMasterKeepingOnes) {
  Net a, b;
  torch::optim::Adam adam(a->parameters(), 0.01);
  auto text = error_text([&] { ampx::initialize(a.ptr(), adam, OptLevel::O2); });
  EXPECT_THAT(text,
              HasSubstr("O2 keeps fp32 master weights, which live in an ampx::optim optimizer"));
  EXPECT_EQ(a->fc1->weight.scalar_type(), torch::kFloat);
  ampx::optim::AdamW with_masters(b->parameters(), ampx::optim::AdamWOptions(0.01));
  text = error_text([&] { ampx::initialize(b.ptr(), with_masters, OptLevel::O3); });
  EXPECT_THAT(text, HasSubstr("O3 has no master weights but optimizers[0] (AdamW) keeps them"));
}

// Convergence in pure bf16 without masters; the stochastic rounding that makes
// it possible is pinned by the next test (nearest rounding passes this one).
TEST(AmpTest, O3TrainsPureBf16WithoutMasters) {
  torch::manual_seed(0);
  Net net;
  ampx::optim::AdamW opt(
      net->parameters(),
      ampx::optim::AdamWOptions(3e-3).master_weights(false).stochastic_rounding(true));
  auto amp = ampx::initialize(net.ptr(), {&opt},
                              AmpOptions(OptLevel::O3).cast_model_outputs(torch::kFloat));
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
  const double loss = train(net, opt, &amp, 150);
  EXPECT_FALSE(opt.master(net->fc1->weight).defined());
  EXPECT_LT(loss, 0.5 * regression_loss_at_start());
}

// What rounding to nearest cannot do. Every weight starts at 1.5, where a
// bf16 ulp is 2^-7 (0.0078125); a constant gradient makes each AdamW step
// exactly lr = 1e-3, below half an ulp. Nearest rounding returns 1.5 after
// every step; stochastic rounding is unbiased, so after 100 steps each weight
// is 1.5 - 0.1 in expectation, with a standard deviation of at most
// sqrt(100) * ulp / 2 = 0.039 per weight and 0.039 / sqrt(225) = 0.0026 for
// the mean of the net's 225 weights.
TEST(AmpTest, O3StochasticRoundingAccumulatesUpdatesBelowHalfAnUlp) {
  Net net;
  ampx::optim::AdamW opt(
      net->parameters(),
      ampx::optim::AdamWOptions(1e-3).weight_decay(0).master_weights(false).stochastic_rounding(
          true));
  auto amp = ampx::initialize(net.ptr(), {&opt}, AmpOptions(OptLevel::O3));
  int64_t count = 0;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters()) {
      ASSERT_EQ(p.scalar_type(), torch::kBFloat16);
      p.fill_(1.5);
      count += p.numel();
    }
  }
  ASSERT_EQ(count, 225);
  const int steps = 100;
  for (int step = 0; step < steps; ++step) {
    for (auto& p : net->parameters()) p.mutable_grad() = torch::ones_like(p);
    amp.scaler().step(opt);
    amp.scaler().update();
  }
  double sum = 0;
  int64_t moved = 0;
  for (const auto& p : net->parameters()) {
    const auto w = p.detach().to(torch::kDouble);
    sum += w.sum().item<double>();
    moved += (w != 1.5).sum().item<int64_t>();
    // Every weight lies in reach of the summed update: well within 1.5 - 0.1
    // plus or minus 6 standard deviations.
    EXPECT_LT((w - 1.4).abs().max().item<double>(), 0.25);
  }
  // (A weight may end on 1.5 by chance, about 2.6 standard deviations away.)
  EXPECT_GT(moved, count * 9 / 10) << "round to nearest leaves every weight at 1.5";
  EXPECT_NEAR(sum / count, 1.5 - steps * 1e-3, 0.016);
}

}  // namespace
