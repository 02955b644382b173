// ampx::optim on real training: stochastic rounding where round-to-nearest
// stalls, unbiased and deterministic; GradScaler's scaler-aware path (scaled
// steps equal unscaled ones bit for bit, an injected inf skips the step);
// fused clipping; bitwise resume from saved state and the refusal of
// mismatched or corrupt state.

#include "ampx/grad_scaler.h"
#include "ampx/optim.h"

#include "optim_test_util.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <memory>
#include <sstream>
#include <tuple>

namespace {

using ampx::test::copy_params;
using ampx::test::error_text;
using ampx::test::full_state;
using ampx::test::load_from_string;
using ampx::test::make_batch;
using ampx::test::same_bits;
using ampx::test::save_to_string;
using ampx::test::snapshot;
using optim_test::kFp32Tol;
using optim_test::make_net;
using optim_test::max_abs_diff;
using optim_test::Net;
using optim_test::train_step;
namespace aopt = ampx::optim;

// --- stochastic rounding -------------------------------------------------------

// Linear regression y = X w* (64 features, bias) trained from the same fp32
// init three ways with plain SGD, lr 3e-3, 400 full-batch steps. Updates of
// 2 * lr * |error| fall below half a bf16 ulp (2^-9 for |w| in [0.5, 1)) long
// before convergence, so round-to-nearest stalls.
struct Regression {
  torch::Tensor x, y, x_eval, y_eval;
  Regression() {
    auto g = at::detail::createCPUGenerator(21);
    const auto w_star = at::randn({64, 1}, g);
    x = at::randn({256, 64}, g);
    y = x.matmul(w_star);
    x_eval = at::randn({512, 64}, g);
    y_eval = x_eval.matmul(w_star);
  }
};

constexpr double kSrLr = 1e-2;

double train_regression(int mode /*0: masters, 1: SR, 2: RTN*/, int64_t* never_changed) {
  static const Regression data;
  torch::manual_seed(22);
  torch::nn::Linear lin(64, 1);
  {
    torch::NoGradGuard no_grad;
    lin->weight.copy_(torch::randn({1, 64}));  // |w| ~ 1: bf16 ulp 2^-7 .. 2^-6
  }
  auto opts = aopt::SGDOptions(kSrLr).master_weights(mode == 0).stochastic_rounding(mode == 1);
  aopt::SGD opt(lin->parameters(), opts.seed(1234));
  opt.capture_master_weights();
  for (auto& p : lin->parameters()) p.set_data(p.detach().to(torch::kBFloat16));
  const auto start = lin->weight.detach().clone();
  for (int s = 0; s < 400; ++s) {
    opt.zero_grad();
    const auto out = lin(data.x.to(torch::kBFloat16)).to(torch::kFloat);
    torch::mse_loss(out, data.y).backward();
    opt.step();
  }
  *never_changed = lin->weight.detach().eq(start).sum().item<int64_t>();
  torch::NoGradGuard no_grad;
  const auto w = mode == 0 ? opt.master(lin->weight) : lin->weight.to(torch::kFloat);
  const auto b = mode == 0 ? opt.master(lin->bias) : lin->bias.to(torch::kFloat);
  return torch::mse_loss(torch::nn::functional::linear(data.x_eval, w, b), data.y_eval)
      .item<double>();
}

TEST(OptimTest, StochasticRoundingTrainsWhereRoundToNearestStalls) {
  int64_t unchanged_master, unchanged_sr, unchanged_rtn;
  const double master = train_regression(0, &unchanged_master);
  const double sr = train_regression(1, &unchanged_sr);
  const double rtn = train_regression(2, &unchanged_rtn);
  // Observed here: see the message. SR within 1.5x of fp32 masters (plus the
  // bf16 quantisation floor, 1e-3); RTN at least 5x above both.
  EXPECT_LE(sr, 1.5 * master + 1e-3) << "masters " << master << " SR " << sr << " RTN " << rtn;
  EXPECT_GE(rtn, 5 * std::max(master, sr))
      << "masters " << master << " SR " << sr << " RTN " << rtn;
  EXPECT_EQ(unchanged_sr, 0);
  EXPECT_EQ(unchanged_master, 0);
  EXPECT_GT(rtn, 0.0);
  RecordProperty("loss_masters", std::to_string(master));
  RecordProperty("loss_sr", std::to_string(sr));
  RecordProperty("loss_rtn", std::to_string(rtn));
}

TEST(OptimTest, StochasticRoundingIsUnbiasedAndDeterministic) {
  // 1.5 - 1e-3 lies between bf16 neighbours 1.4921875 and 1.5 (ulp 2^-7).
  const int64_t n = 200000;
  auto run = [&](uint64_t seed) {
    auto p = torch::full({n}, 1.5, torch::kBFloat16).requires_grad_();
    aopt::SGD opt(
        {p}, aopt::SGDOptions(1e-3).master_weights(false).stochastic_rounding(true).seed(seed));
    p.mutable_grad() = torch::ones({n}, torch::kBFloat16);
    opt.step();
    return p.detach().clone();
  };
  const auto a = run(7), b = run(7), c = run(8);
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_FALSE(torch::equal(a, c));
  const auto vals = a.to(torch::kDouble);
  EXPECT_TRUE(vals.eq(1.5).logical_or(vals.eq(1.4921875)).all().item<bool>());
  // Each element is 1.5 - 2^-7 * Bernoulli(0.128): the mean's standard error
  // is 2^-7 * sqrt(0.128 * 0.872 / n) = 5.8e-6; allow 5 of them.
  EXPECT_NEAR(vals.mean().item<double>(), 1.5 - 1e-3, 3e-5);
  // Round to nearest keeps every element at 1.5.
  auto p = torch::full({n}, 1.5, torch::kBFloat16).requires_grad_();
  aopt::SGD rtn({p}, aopt::SGDOptions(1e-3).master_weights(false));
  p.mutable_grad() = torch::ones({n}, torch::kBFloat16);
  rtn.step();
  EXPECT_TRUE(p.detach().eq(1.5).all().item<bool>());
}

// --- GradScaler ---------------------------------------------------------------

enum class ScalerMode { kNone, kScaled, kUnscaleFirst };

// A bf16 model with fp32 masters (and an fp32 one) trained 8 steps.
std::vector<torch::Tensor> scaler_run(ScalerMode mode, torch::ScalarType dtype, bool poison) {
  auto net = make_net(30);
  aopt::AdamW opt(net->parameters(), aopt::AdamWOptions(1e-2));
  opt.capture_master_weights();
  for (auto& p : net->parameters()) p.set_data(p.detach().to(dtype));
  ampx::GradScaler scaler(ampx::GradScalerOptions().init_scale(1024.0));
  for (int s = 0; s < 8; ++s) {
    const auto b = make_batch(200 + s);
    opt.zero_grad();
    auto loss = torch::mse_loss(net->forward(b.x), b.y);
    if (mode == ScalerMode::kNone) {
      if (poison && s == 5) continue;  // the step a poisoned run skips
      loss.backward();
      opt.step();
      continue;
    }
    scaler.scale(loss).backward();
    if (poison && s == 5) {
      net->parameters()[2].mutable_grad().view(-1)[1] = std::numeric_limits<float>::infinity();
    }
    if (mode == ScalerMode::kUnscaleFirst) scaler.unscale_(opt);
    const auto grads_before = snapshot({net->parameters()[0].grad()});
    const auto state_before = full_state(opt);
    if (poison && s == 5) {
      const double scale_before = scaler.get_scale();
      EXPECT_FALSE(scaler.step(opt).stepped());
      EXPECT_TRUE(same_bits(state_before, full_state(opt)));  // nothing changed, bitwise
      scaler.update();
      EXPECT_EQ(scaler.get_scale(), scale_before * 0.5);
      continue;
    }
    EXPECT_TRUE(scaler.step(opt).stepped());
    if (mode == ScalerMode::kScaled) {
      // Scaler-aware path: the scaler only checked the grads, the step unscaled them.
      EXPECT_TRUE(same_bits(grads_before, {net->parameters()[0].grad()}));
    }
    scaler.update();
  }
  return full_state(opt);
}

TEST(OptimTest, ScaledStepsEqualUnscaledOnesBitwise) {
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const auto plain = scaler_run(ScalerMode::kNone, dtype, false);
    EXPECT_TRUE(same_bits(plain, scaler_run(ScalerMode::kScaled, dtype, false))) << dtype;
    EXPECT_TRUE(same_bits(plain, scaler_run(ScalerMode::kUnscaleFirst, dtype, false))) << dtype;
  }
}

TEST(OptimTest, InjectedInfSkipsTheStepBitwiseAndBacksOff) {
  for (auto mode : {ScalerMode::kScaled, ScalerMode::kUnscaleFirst}) {
    // Equal to an unscaled run that leaves out step 5 (step counts included).
    EXPECT_TRUE(same_bits(scaler_run(mode, torch::kBFloat16, true),
                          scaler_run(ScalerMode::kNone, torch::kBFloat16, true)));
  }
}

// --- fused clipping -------------------------------------------------------------

TEST(OptimTest, FusedClippingEqualsClipGradNormThenStep) {
  auto a = make_net(40), b = make_net(41), c = make_net(42);
  copy_params(*a, *b);
  copy_params(*a, *c);
  aopt::AdamW fused(a->parameters(), aopt::AdamWOptions(1e-2).max_grad_norm(0.05));
  aopt::AdamW plain(b->parameters(), aopt::AdamWOptions(1e-2));
  aopt::AdamW scaled(c->parameters(), aopt::AdamWOptions(1e-2).max_grad_norm(0.05));
  ampx::GradScaler scaler(ampx::GradScalerOptions().init_scale(256.0));
  int clipped = 0;
  for (int s = 0; s < 30; ++s) {
    const auto batch = make_batch(300 + s);
    fused.zero_grad();
    torch::mse_loss(a->forward(batch.x), batch.y).backward();
    fused.step();
    plain.zero_grad();
    torch::mse_loss(b->forward(batch.x), batch.y).backward();
    clipped += torch::nn::utils::clip_grad_norm_(b->parameters(), 0.05) > 0.05;
    plain.step();
    scaled.zero_grad();
    scaler.scale(torch::mse_loss(c->forward(batch.x), batch.y)).backward();
    scaler.step(scaled);  // norm of scaled grads / scale, inside the step
    scaler.update();
  }
  EXPECT_GT(clipped, 20);  // the bound is active
  EXPECT_LE(max_abs_diff(a->parameters(), b->parameters()), kFp32Tol);
  EXPECT_LE(max_abs_diff(a->parameters(), c->parameters()), kFp32Tol);
}

// --- state: save, load, resume ---------------------------------------------------

template <class Opt, class Options>
void check_resume(Options options) {
  auto run = [&](Net& net, Opt& opt, int from, int to) {
    for (int s = from; s < to; ++s) train_step(net, opt, s);
  };
  auto make = [&](int64_t seed) {
    auto net = make_net(seed);
    auto opt = std::make_unique<Opt>(net->parameters(), options);
    opt->capture_master_weights();
    for (auto& p : net->parameters()) p.set_data(p.detach().to(torch::kBFloat16));
    return std::make_pair(net, std::move(opt));
  };
  auto whole = make(50);
  run(whole.first, *whole.second, 0, 20);

  auto first = make(50);
  run(first.first, *first.second, 0, 10);
  const auto bytes = save_to_string(*first.second);
  const auto params = snapshot(first.first->parameters());
  auto resumed = make(51);  // a different init: everything must come from the state
  {
    torch::NoGradGuard no_grad;
    auto ps = resumed.first->parameters();
    for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(params[i]);
  }
  load_from_string(*resumed.second, bytes);
  run(resumed.first, *resumed.second, 10, 20);
  EXPECT_TRUE(same_bits(full_state(*whole.second), full_state(*resumed.second)));
}

TEST(OptimTest, ResumeFromSavedStateIsBitwise) {
  check_resume<aopt::AdamW>(aopt::AdamWOptions(1e-2));
  check_resume<aopt::SGD>(aopt::SGDOptions(1e-2).momentum(0.9));
  check_resume<aopt::LAMB>(aopt::LAMBOptions(1e-2));
  check_resume<aopt::SGD>(
      aopt::SGDOptions(1e-3).master_weights(false).stochastic_rounding(true).seed(99));
}

TEST(OptimTest, MismatchedOrCorruptStateIsRefusedAndChangesNothing) {
  auto net = make_net(60);
  aopt::AdamW opt(net->parameters(), aopt::AdamWOptions(1e-2));
  for (int s = 0; s < 3; ++s) train_step(net, opt, s);
  const auto before = full_state(opt);

  auto other = make_net(61, /*hidden=*/12);
  aopt::AdamW other_opt(other->parameters(), aopt::AdamWOptions(1e-2));
  train_step(other, other_opt, 0);
  EXPECT_EQ(error_text([&] { load_from_string(opt, save_to_string(other_opt)); }),
            "ampx::optim::AdamW::load: group0.param0.exp_avg has shape [12, 8], expected [16, 8]");
  EXPECT_TRUE(same_bits(before, full_state(opt)));

  auto net2 = make_net(62);
  aopt::SGD sgd(net2->parameters(), aopt::SGDOptions(0.1));
  EXPECT_EQ(error_text([&] { load_from_string(opt, save_to_string(sgd)); }),
            "ampx::optim::AdamW::load: the state was saved by ampx::optim::SGD, not "
            "ampx::optim::AdamW");
  torch::optim::AdamW libtorch_opt(net2->parameters());
  EXPECT_EQ(error_text([&] { load_from_string(opt, save_to_string(libtorch_opt)); }),
            "ampx::optim::AdamW::load: the archive has no 'ampx_optim_version' (not an "
            "ampx::optim state, or a corrupt one)");
  {
    torch::serialize::OutputArchive out;
    out.write("ampx_optim_version", c10::IValue(int64_t(99)));
    std::ostringstream ss;
    out.save_to(ss);
    EXPECT_EQ(error_text([&] { load_from_string(opt, ss.str()); }),
              "ampx::optim::AdamW::load: state version 99 is not supported (this build reads "
              "versions 1 and 2)");
  }
  auto bytes = save_to_string(opt);
  bytes.resize(bytes.size() / 2);  // truncated file
  EXPECT_NE(error_text([&] { load_from_string(opt, bytes); }), "");
  EXPECT_TRUE(same_bits(before, full_state(opt)));
}

}  // namespace
