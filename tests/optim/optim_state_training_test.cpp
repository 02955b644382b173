// ampx::optim's Kahan-compensated weights and the moments in fewer bits in
// training: a Kahan step bit for bit, Kahan against fp32 masters, skipped
// steps that touch nothing, bitwise resume, each format's loss, and the
// refusals of mismatched states and unsupported params
// (optim_state_test.cpp: each format's arithmetic).

#include "ampx/optim.h"

#include "../test_util.h"
#include "ampx/grad_scaler.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {
namespace state_training_test {  // (unity builds: apart from the other tests' helpers)

namespace aopt = ampx::optim;
using ampx::test::error_text;
using ampx::test::load_from_string;
using ampx::test::same_bits;
using ampx::test::save_to_string;
using aopt::StateFormat;

constexpr StateFormat kLowBit[] = {StateFormat::kBf16, StateFormat::kFp8, StateFormat::kInt8};
// --- Kahan weights --------------------------------------------------------------

TEST(OptimStateTest, KahanStepIsTheFp32UpdateSplitIntoWeightAndLostBits) {
  // SGD without momentum: w = (p + c) - lr * (g + wd * (p + c)) in fp32;
  // then p = bf16(w), c = bf16(w - p), element by element.
  auto g = at::detail::createCPUGenerator(5);
  auto p = at::randn({3000}, g).to(torch::kBFloat16).requires_grad_();
  aopt::SGD opt(
      {p}, aopt::SGDOptions(1e-3).weight_decay(0.01).master_weights(false).kahan_summation(true));
  for (int s = 0; s < 5; ++s) {
    const auto grad = at::randn({3000}, g).to(torch::kBFloat16);
    p.mutable_grad() = grad;
    const auto c = opt.compensation(p);
    const auto w0 = c.defined() ? p.detach().to(torch::kFloat) + c.to(torch::kFloat)
                                : p.detach().to(torch::kFloat);
    const auto gf = grad.to(torch::kFloat);
    const auto w = w0 + (gf + w0 * 0.01f) * -1e-3f;
    opt.step();
    const auto p_exp = w.to(torch::kBFloat16);
    const auto c_exp = (w - p_exp.to(torch::kFloat)).to(torch::kBFloat16);
    EXPECT_TRUE(torch::equal(p.detach(), p_exp)) << "step " << s;
    EXPECT_TRUE(torch::equal(opt.compensation(p), c_exp)) << "step " << s;
  }
}

// y = x w* regression with a bf16 Linear; `mode` 0: fp32 masters, 1: Kahan,
// 2: nearest rounding of the bf16 weight. The eval loss after 400 SGD steps.
double kahan_regression(int mode) {
  auto g = at::detail::createCPUGenerator(21);
  const auto w_star = at::randn({64, 1}, g);
  const auto x = at::randn({256, 64}, g), y = x.matmul(w_star);
  const auto x_eval = at::randn({512, 64}, g), y_eval = x_eval.matmul(w_star);
  torch::manual_seed(22);
  torch::nn::Linear lin(64, 1);
  {
    torch::NoGradGuard no_grad;
    lin->weight.copy_(torch::randn({1, 64}));  // |w| ~ 1: bf16 spacing 2^-7 .. 2^-6
  }
  aopt::SGD opt(lin->parameters(),
                aopt::SGDOptions(1e-2).master_weights(mode == 0).kahan_summation(mode == 1));
  opt.capture_master_weights();
  for (auto& p : lin->parameters()) p.set_data(p.detach().to(torch::kBFloat16));
  for (int s = 0; s < 400; ++s) {
    opt.zero_grad();
    torch::mse_loss(lin(x.to(torch::kBFloat16)).to(torch::kFloat), y).backward();
    opt.step();
  }
  torch::NoGradGuard no_grad;
  auto weight = [&](const torch::Tensor& p) {
    if (mode == 0) return opt.master(p);
    if (mode == 1) return p.to(torch::kFloat) + opt.compensation(p).to(torch::kFloat);
    return p.to(torch::kFloat);
  };
  return torch::mse_loss(
             torch::nn::functional::linear(x_eval, weight(lin->weight), weight(lin->bias)), y_eval)
      .item<double>();
}

TEST(OptimStateTest, KahanWeightsTrainAsFp32MastersWhereRoundingToNearestStalls) {
  const double master = kahan_regression(0), kahan = kahan_regression(1),
               nearest = kahan_regression(2);
  EXPECT_LE(kahan, 1.05 * master + 1e-6) << "masters " << master << " nearest " << nearest;
  EXPECT_GE(nearest, 5 * kahan) << "masters " << master << " kahan " << kahan;
  RecordProperty("loss_masters", std::to_string(master));
  RecordProperty("loss_kahan", std::to_string(kahan));
  RecordProperty("loss_nearest", std::to_string(nearest));
}

// --- training, skipping, resuming -----------------------------------------------

using Net = ampx::test::Mlp;

// A bf16 MLP whose every param has coded moments (state_min_numel 0, blocks
// of 32: partial blocks everywhere) and Kahan weights.
struct LowBitRun {
  Net net{nullptr};
  std::unique_ptr<aopt::AdamW> opt;
  LowBitRun(StateFormat format, int64_t seed) {
    torch::manual_seed(seed);
    net = Net(48, /*float_output=*/true);
    opt = std::make_unique<aopt::AdamW>(net->parameters(), aopt::AdamWOptions(1e-2)
                                                               .master_weights(false)
                                                               .kahan_summation(true)
                                                               .state_format(format)
                                                               .state_block(32)
                                                               .state_min_numel(0));
    for (auto& p : net->parameters()) p.set_data(p.detach().to(torch::kBFloat16));
  }
  double step(int64_t s) {
    const auto b = ampx::test::make_batch(400 + s);
    opt->zero_grad();
    auto loss = torch::mse_loss(net->forward(b.x), b.y);
    loss.backward();
    opt->step();
    return loss.item<double>();
  }
};

TEST(OptimStateTest, InfGradientsLeaveCodesScalesAndCompensationsUntouched) {
  for (const auto format : kLowBit) {
    SCOPED_TRACE(aopt::state_format_name(format));
    LowBitRun run(format, 8);
    for (int s = 0; s < 3; ++s) run.step(s);
    ampx::GradScaler scaler(ampx::GradScalerOptions().init_scale(1024.0));
    const auto b = ampx::test::make_batch(9);
    run.opt->zero_grad();
    scaler.scale(torch::mse_loss(run.net->forward(b.x), b.y)).backward();
    run.net->parameters()[0].mutable_grad().view(-1)[3] = std::numeric_limits<float>::infinity();
    const auto before = ampx::test::full_state(*run.opt);
    const auto bytes = save_to_string(*run.opt);
    EXPECT_FALSE(scaler.step(*run.opt).stepped());
    EXPECT_TRUE(same_bits(before, ampx::test::full_state(*run.opt)));
    // Codes and scales too, as saved (the decoded moments could hide a
    // change of both).
    LowBitRun a(format, 8), b2(format, 8);
    load_from_string(*a.opt, bytes);
    load_from_string(*b2.opt, save_to_string(*run.opt));
    for (auto* r : {&a, &b2}) {
      torch::NoGradGuard no_grad;
      auto ps = r->net->parameters();
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(run.net->parameters()[i]);
    }
    a.step(20);
    b2.step(20);
    EXPECT_TRUE(same_bits(ampx::test::full_state(*a.opt), ampx::test::full_state(*b2.opt)));
  }
}

TEST(OptimStateTest, ResumeFromSavedLowBitStateIsBitwise) {
  for (const auto format : kLowBit) {
    SCOPED_TRACE(aopt::state_format_name(format));
    LowBitRun whole(format, 12);
    for (int s = 0; s < 12; ++s) whole.step(s);
    LowBitRun first(format, 12);
    for (int s = 0; s < 6; ++s) first.step(s);
    const auto bytes = save_to_string(*first.opt);
    LowBitRun resumed(format, 13);  // another init: everything comes from the state
    {
      torch::NoGradGuard no_grad;
      auto ps = resumed.net->parameters();
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(first.net->parameters()[i]);
    }
    load_from_string(*resumed.opt, bytes);
    for (int s = 6; s < 12; ++s) resumed.step(s);
    EXPECT_TRUE(
        same_bits(ampx::test::full_state(*whole.opt), ampx::test::full_state(*resumed.opt)));
  }
}

TEST(OptimStateTest, EveryFormatTrainsAsFp32Moments) {
  // 300 steps of the MLP regression over 50 batches: the mean loss of the
  // last pass over them, for each format within 5% of fp32 moments' (Kahan
  // weights throughout).
  auto final_loss = [](StateFormat format) {
    LowBitRun run(format, 3);
    double last_pass = 0;
    for (int s = 0; s < 300; ++s) {
      const double loss = run.step(s % 50);
      if (s >= 250) last_pass += loss / 50;
    }
    return last_pass;
  };
  const double fp32 = final_loss(StateFormat::kFp32);
  for (const auto format : kLowBit) {
    const double loss = final_loss(format);
    EXPECT_LE(loss, 1.05 * fp32) << aopt::state_format_name(format) << " vs fp32 " << fp32;
    RecordProperty(std::string("loss_") + aopt::state_format_name(format), std::to_string(loss));
  }
  RecordProperty("loss_fp32", std::to_string(fp32));
}

// A block whose gradients span 10^4 (one element 1e3, the others 0.1):
// its first moments span 10^4 and keep their codes, its second moments span
// 10^8 (2^26.6), past E4M3's 2^17.8 and the 8-bit map's 2^22.5 (its smallest
// value, 3.25e-7). Had the small ones coded to 0 (torchao's AdamWFp8 and
// AdamW8bit do), the next step, whose gradients for them are 0, would divide
// m by eps alone and move them by millions of lr; they code to code 1, and
// every element moves by at most 3 lr (Adam's steps are about lr), as with
// fp32 moments (0.67 lr).
TEST(OptimStateTest, SecondMomentsThatWouldFlushToZeroDoNotBlowUpTheNextStep) {
  for (const auto format : {StateFormat::kFp32, StateFormat::kFp8, StateFormat::kInt8}) {
    SCOPED_TRACE(aopt::state_format_name(format));
    auto p = torch::zeros({4096}).requires_grad_();
    const double lr = 1e-3;
    aopt::AdamW opt({p}, aopt::AdamWOptions(lr).weight_decay(0).state_format(format));
    auto g = torch::full({4096}, 0.1f);
    g[0] = 1e3f;
    p.mutable_grad() = g.clone();
    opt.step();
    const auto v = opt.exp_avg_sq(p).narrow(0, 1, 255);
    EXPECT_GT(v.min().item<float>(), 0.f) << "a second moment coded to zero";
    EXPECT_GT(opt.exp_avg(p).narrow(0, 1, 255).min().item<float>(), 0.f);
    const auto before = p.detach().clone();
    g.narrow(0, 1, 4095).zero_();
    p.mutable_grad() = g.clone();
    opt.step();
    const double moved = (p.detach() - before).abs().max().item<double>();
    EXPECT_LE(moved, 3 * lr);
    RecordProperty(std::string("moved_lr_") + aopt::state_format_name(format),
                   std::to_string(moved / lr));
  }
}

// --- refusals -------------------------------------------------------------------

TEST(OptimStateTest, AStateOfAnotherFormatBlockOrWeightIsRefusedNamingBoth) {
  LowBitRun int8(StateFormat::kInt8, 4);
  for (int s = 0; s < 2; ++s) int8.step(s);
  const auto before = ampx::test::full_state(*int8.opt);
  LowBitRun fp8(StateFormat::kFp8, 4);
  fp8.step(0);
  EXPECT_EQ(error_text([&] { load_from_string(*int8.opt, save_to_string(*fp8.opt)); }),
            "ampx::optim::AdamW::load: the state was saved with state_format fp8, this optimizer "
            "has state_format 8bit");
  auto net = int8.net;
  aopt::AdamW other_block(net->parameters(), aopt::AdamWOptions(1e-2)
                                                 .master_weights(false)
                                                 .kahan_summation(true)
                                                 .state_format(StateFormat::kInt8)
                                                 .state_block(64)
                                                 .state_min_numel(0));
  EXPECT_EQ(error_text([&] { load_from_string(*int8.opt, save_to_string(other_block)); }),
            "ampx::optim::AdamW::load: the state was saved with state_block 64, this optimizer "
            "has state_block 32");
  aopt::AdamW no_kahan(net->parameters(), aopt::AdamWOptions(1e-2)
                                              .master_weights(false)
                                              .state_format(StateFormat::kInt8)
                                              .state_block(32)
                                              .state_min_numel(0));
  EXPECT_EQ(error_text([&] { load_from_string(*int8.opt, save_to_string(no_kahan)); }),
            "ampx::optim::AdamW::load: the state was saved with kahan_summation(false), this "
            "optimizer has kahan_summation(true)");
  // A corrupt scale.
  {
    torch::serialize::OutputArchive out;
    int8.opt->save(out);
    std::ostringstream ss;
    out.save_to(ss);
    std::istringstream is(ss.str());
    torch::serialize::InputArchive in;
    in.load_from(is);
    torch::serialize::OutputArchive bad;
    for (const auto& key : in.keys()) {
      c10::IValue v;
      in.read(key, v);
      if (key == "group0.param0.exp_avg_scale") {
        auto t = v.toTensor().clone();
        t[1] = -1.0f;
        bad.write(key, t, /*is_buffer=*/true);
      } else if (v.isTensor()) {
        bad.write(key, v.toTensor(), /*is_buffer=*/true);
      } else {
        bad.write(key, v);
      }
    }
    std::ostringstream bs;
    bad.save_to(bs);
    EXPECT_EQ(error_text([&] { load_from_string(*int8.opt, bs.str()); }),
              "ampx::optim::AdamW::load: group0.param0.exp_avg_scale has a negative or non-finite "
              "scale");
  }
  EXPECT_TRUE(same_bits(before, ampx::test::full_state(*int8.opt)));
}

TEST(OptimStateTest, OptionsAreCheckedAndUnsupportedParamsRefused) {
  auto p = torch::zeros({8}, torch::kBFloat16).requires_grad_();
  EXPECT_EQ(error_text([&] { aopt::AdamW({p}, aopt::AdamWOptions().kahan_summation(true)); }),
            "ampx::optim: kahan_summation(true) keeps the lost low bits of bf16/fp16 params that "
            "have no fp32 master; it needs master_weights(false)");
  EXPECT_EQ(
      error_text([&] {
        aopt::AdamW(
            {p},
            aopt::AdamWOptions().master_weights(false).kahan_summation(true).stochastic_rounding(
                true));
      }),
      "ampx::optim: kahan_summation(true) and stochastic_rounding(true) are two ways to keep "
      "small updates of bf16 params; choose one");
  for (int64_t block : {16, 48, 8192}) {
    EXPECT_EQ(error_text([&] { aopt::AdamW({p}, aopt::AdamWOptions().state_block(block)); }),
              "ampx::optim: state_block must be a power of 2 in [32, 4096], got " +
                  std::to_string(block));
  }
  EXPECT_EQ(error_text([&] { aopt::state_format_from_name("int4"); }),
            "ampx::optim: unknown state format 'int4'; expected fp32, bf16, fp8 or 8bit");
  for (const auto f :
       {StateFormat::kFp32, StateFormat::kBf16, StateFormat::kFp8, StateFormat::kInt8}) {
    EXPECT_EQ(aopt::state_format_from_name(aopt::state_format_name(f)), f);
  }
  // A non-contiguous param takes the ATen path, which keeps fp32 moments.
  auto base = torch::zeros({64, 80});
  auto view = base.t().requires_grad_();
  aopt::AdamW opt({view}, aopt::AdamWOptions().state_format(StateFormat::kFp8));
  view.mutable_grad() = torch::ones({80, 64}).t().contiguous().t();
  EXPECT_EQ(error_text([&] { opt.step(); }),
            "ampx::optim::AdamW: state_format fp8 is implemented for dense CPU and CUDA params and "
            "grads; "
            "param (group 0, index 0) is not contiguous");
}

}  // namespace state_training_test
}  // namespace
