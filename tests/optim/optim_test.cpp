// ampx::optim: LibTorch's trajectories on fp32, double references for master
// weights and LAMB, the per-tensor path of non-contiguous params, captured
// masters (on real training: optim_training_test.cpp; the fused steps:
// optim_fused_test.cpp).

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
using ampx::test::make_batch;
using ampx::test::snapshot;
using ampx::test::strided_copy;
namespace aopt = ampx::optim;

using optim_test::kFp32Tol;
using optim_test::make_net;
using optim_test::max_abs_diff;
using optim_test::Net;
using optim_test::train_step;

// --- fp32: LibTorch's trajectories ------------------------------------------

TEST(OptimTest, AdamWMatchesLibTorchOnFp32) {
  struct Case {
    double wd;
    double b1, b2, eps;
  };
  for (const auto& c :
       {Case{0.0, 0.9, 0.999, 1e-8}, Case{1e-2, 0.9, 0.999, 1e-8}, Case{0.1, 0.8, 0.99, 1e-6}}) {
    auto a = make_net(1), b = make_net(2);
    copy_params(*a, *b);
    aopt::AdamW ours(a->parameters(),
                     aopt::AdamWOptions(1e-2).weight_decay(c.wd).betas({c.b1, c.b2}).eps(c.eps));
    torch::optim::AdamW ref(
        b->parameters(),
        torch::optim::AdamWOptions(1e-2).weight_decay(c.wd).betas({c.b1, c.b2}).eps(c.eps));
    for (int s = 0; s < 50; ++s) {
      train_step(a, ours, s);
      train_step(b, ref, s);
    }
    EXPECT_LE(max_abs_diff(a->parameters(), b->parameters()), kFp32Tol) << "wd " << c.wd;
    EXPECT_EQ(ours.step_count(a->parameters()[0]), 50);
  }
}

TEST(OptimTest, SGDMatchesLibTorchOnFp32) {
  struct Case {
    double momentum, dampening, wd;
    bool nesterov;
  };
  for (const auto& c :
       {Case{0, 0, 0, false}, Case{0, 0, 1e-2, false}, Case{0.9, 0, 0, false},
        Case{0.9, 0.3, 1e-2, false}, Case{0.9, 0, 0, true}, Case{0.8, 0, 1e-2, true}}) {
    auto a = make_net(3), b = make_net(4);
    copy_params(*a, *b);
    aopt::SGD ours(a->parameters(), aopt::SGDOptions(0.05)
                                        .momentum(c.momentum)
                                        .dampening(c.dampening)
                                        .weight_decay(c.wd)
                                        .nesterov(c.nesterov));
    torch::optim::SGD ref(b->parameters(), torch::optim::SGDOptions(0.05)
                                               .momentum(c.momentum)
                                               .dampening(c.dampening)
                                               .weight_decay(c.wd)
                                               .nesterov(c.nesterov));
    for (int s = 0; s < 50; ++s) {
      train_step(a, ours, s);
      train_step(b, ref, s);
    }
    EXPECT_LE(max_abs_diff(a->parameters(), b->parameters()), kFp32Tol)
        << "momentum " << c.momentum << " dampening " << c.dampening << " wd " << c.wd
        << " nesterov " << c.nesterov;
  }
}

// A group whose momentum is set to 0 mid-run keeps its buffer but no longer
// uses it, as in LibTorch (dampening then changes nothing either).
TEST(OptimTest, SGDGroupSwitchedToZeroMomentumLeavesItsBufferAlone) {
  auto a = make_net(3), b = make_net(4);
  copy_params(*a, *b);
  aopt::SGD ours(a->parameters(), aopt::SGDOptions(0.05).momentum(0.9).dampening(0.5));
  torch::optim::SGD ref(b->parameters(),
                        torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.5));
  for (int s = 0; s < 10; ++s) {
    if (s == 5) {
      static_cast<aopt::SGDOptions&>(ours.param_groups()[0].options()).momentum(0);
      static_cast<torch::optim::SGDOptions&>(ref.param_groups()[0].options()).momentum(0);
    }
    train_step(a, ours, s);
    train_step(b, ref, s);
  }
  EXPECT_LE(max_abs_diff(a->parameters(), b->parameters()), kFp32Tol);
}

TEST(OptimTest, WorksWithLibTorchSchedulersAndZeroGrad) {
  auto net = make_net(5), ref_net = make_net(5);
  aopt::AdamW opt(net->parameters(), aopt::AdamWOptions(1e-2));
  torch::optim::AdamW ref(ref_net->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::StepLR sched(opt, /*step_size=*/2, /*gamma=*/0.5);
  torch::optim::StepLR ref_sched(ref, /*step_size=*/2, /*gamma=*/0.5);
  for (int s = 0; s < 5; ++s) {
    train_step(net, opt, s);
    train_step(ref_net, ref, s);
    sched.step();
    ref_sched.step();
    EXPECT_EQ(opt.param_groups()[0].options().get_lr(), ref.param_groups()[0].options().get_lr());
  }
  EXPECT_LT(opt.param_groups()[0].options().get_lr(), 1e-2);
  EXPECT_LE(max_abs_diff(net->parameters(), ref_net->parameters()), kFp32Tol);
  opt.zero_grad();
  for (const auto& p : net->parameters()) {
    EXPECT_TRUE(!p.grad().defined() || p.grad().abs().sum().item<double>() == 0.0);
  }
}

TEST(OptimTest, OptionsAreCheckedInTheConstructor) {
  auto net = make_net(6);
  EXPECT_EQ(error_text([&] { aopt::AdamW(net->parameters(), aopt::AdamWOptions(-1.0)); }),
            "ampx::optim::AdamW: lr must be >= 0, got -1");
  EXPECT_EQ(error_text([&] {
              aopt::AdamW(net->parameters(), aopt::AdamWOptions().betas({0.9, 1.0}));
            }),
            "ampx::optim::AdamW: betas[1] must be in [0, 1), got 1");
  EXPECT_EQ(error_text([&] { aopt::SGD(net->parameters(), aopt::SGDOptions(0.1).nesterov(true)); }),
            "ampx::optim::SGD: nesterov needs momentum > 0 and dampening 0, got momentum 0, "
            "dampening 0");
  EXPECT_EQ(error_text([&] {
              aopt::SGD(net->parameters(), aopt::SGDOptions(0.1).stochastic_rounding(true));
            }),
            "ampx::optim: stochastic_rounding(true) rounds bf16 params that have no fp32 "
            "master; it needs master_weights(false)");
  EXPECT_EQ(
      error_text([&] { aopt::LAMB(net->parameters(), aopt::LAMBOptions().max_grad_norm(0.0)); }),
      "ampx::optim: max_grad_norm must be > 0, got 0");
}

// --- low precision with masters: double references ---------------------------

enum class Algo { kAdamW, kSGD, kLamb };

// Double-precision reference of one param's trajectory.
struct Reference {
  Algo algo;
  double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 1e-2, momentum = 0.9, dampening = 0.1;
  torch::Tensor w = {}, m = {}, v = {};
  int64_t step = 0;
  void update(const torch::Tensor& g) {  // all double
    ++step;
    if (!m.defined()) {
      m = torch::zeros_like(w);
      v = torch::zeros_like(w);
    }
    const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    switch (algo) {
      case Algo::kAdamW:
        w = w * (1 - lr * wd);
        m = b1 * m + (1 - b1) * g;
        v = b2 * v + (1 - b2) * g * g;
        w = w - lr / bc1 * m / (v.sqrt() / std::sqrt(bc2) + eps);
        break;
      case Algo::kSGD: {
        const auto d = g + wd * w;
        m = step == 1 ? d : momentum * m + (1 - dampening) * d;
        w = w - lr * m;
        break;
      }
      case Algo::kLamb: {
        m = b1 * m + (1 - b1) * g;
        v = b2 * v + (1 - b2) * g * g;
        const auto u = (m / bc1) / ((v / bc2).sqrt() + eps) + wd * w;
        const double wn = w.norm().item<double>(), un = u.norm().item<double>();
        w = w - lr * ((wn > 0 && un > 0) ? wn / un : 1.0) * u;
        break;
      }
    }
  }
};

std::unique_ptr<aopt::MixedPrecisionOptimizer> make_opt(Algo algo, std::vector<torch::Tensor> ps,
                                                        const Reference& r) {
  switch (algo) {
    case Algo::kAdamW:
      return std::make_unique<aopt::AdamW>(
          ps, aopt::AdamWOptions(r.lr).betas({r.b1, r.b2}).eps(r.eps).weight_decay(r.wd));
    case Algo::kSGD:
      return std::make_unique<aopt::SGD>(
          ps,
          aopt::SGDOptions(r.lr).momentum(r.momentum).dampening(r.dampening).weight_decay(r.wd));
    default:
      return std::make_unique<aopt::LAMB>(
          ps, aopt::LAMBOptions(r.lr).betas({r.b1, r.b2}).eps(r.eps).weight_decay(r.wd));
  }
}

// 30 steps on params of 70001 elements (two 64K chunks, a vector tail) and 37
// (tail only), with grads in the params' dtype. The fp32 master stays within
// 30 fp32 ulps of the weight (one per step: 30 * 2^-23 * |w|, plus 1e-6 for
// the rounding of momenta and updates where |w| is near 0) of the double
// trajectory; the param is always the master rounded to nearest even.
// strided: every param is a stride-2 view (a non-contiguous leaf), which
// takes the per-tensor path of ATen ops (update_generic) instead of the fused
// CPU kernels; the same reference and the same checks hold for it.
void check_against_reference(Algo algo, torch::ScalarType dtype, bool strided = false) {
  const std::vector<int64_t> sizes = {70001, 37};
  std::vector<torch::Tensor> params;
  std::vector<Reference> refs;
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto g = at::detail::createCPUGenerator(7 + i);
    const auto values = at::randn({sizes[i]}, g).to(dtype);
    if (strided) {
      auto view = strided_copy(values);
      ASSERT_FALSE(view.is_contiguous());
      params.push_back(view.requires_grad_());
    } else {
      params.push_back(values.requires_grad_());
    }
    refs.push_back(Reference{algo});
    refs.back().w = params.back().detach().to(torch::kDouble);
    if (algo == Algo::kLamb) refs.back().eps = 1e-6;
  }
  auto opt = make_opt(algo, params, refs[0]);
  for (int s = 0; s < 30; ++s) {
    for (size_t i = 0; i < params.size(); ++i) {
      auto g = at::detail::createCPUGenerator(1000 * s + i);
      params[i].mutable_grad() = (at::randn({sizes[i]}, g) * 0.5).to(dtype);
      refs[i].update(params[i].grad().to(torch::kDouble));
    }
    opt->step();
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const auto master = opt->master(params[i]);
    ASSERT_TRUE(master.defined());
    EXPECT_EQ(master.scalar_type(), torch::kFloat);
    const auto bound = refs[i].w.abs() * (30 * std::ldexp(1.0, -23)) + 1e-6;
    const auto excess = (master.to(torch::kDouble) - refs[i].w).abs() - bound;
    EXPECT_LE(excess.max().item<double>(), 0.0) << "param " << i << " dtype " << dtype;
    EXPECT_TRUE(torch::equal(params[i].detach(), master.to(dtype))) << "param " << i;
  }
}

class MastersFollowDoubleReference
    : public testing::TestWithParam<std::tuple<Algo, torch::ScalarType, bool>> {};

// The 16-bit param must equal its master rounded after every step, on the
// fused path and on the per-tensor one (strided params).
TEST_P(MastersFollowDoubleReference, OnBf16AndFp16Params) {
  check_against_reference(std::get<0>(GetParam()), std::get<1>(GetParam()),
                          std::get<2>(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(
    OptimTest, MastersFollowDoubleReference,
    testing::Combine(testing::Values(Algo::kAdamW, Algo::kSGD, Algo::kLamb),
                     testing::Values(torch::kBFloat16, torch::kHalf), testing::Bool()),
    [](const testing::TestParamInfo<std::tuple<Algo, torch::ScalarType, bool>>& info) {
      const Algo algo = std::get<0>(info.param);
      return std::string(algo == Algo::kAdamW ? "AdamW"
                         : algo == Algo::kSGD ? "SGD"
                                              : "LAMB") +
             (std::get<1>(info.param) == torch::kHalf ? "Fp16" : "Bf16") +
             (std::get<2>(info.param) ? "Strided" : "");
    });

// LibTorch starts SGD's momentum buffer as the update itself the first time
// the group has momentum, which need not be the param's first step: here
// momentum (with dampening, which the first use skips) is switched on at the
// fourth step. The fused kernels (contiguous params) and the per-tensor path
// (a strided view) both follow torch::optim::SGD.
TEST(OptimTest, SGDMomentumSwitchedOnLaterStartsItsBufferAsLibTorch) {
  for (const bool strided : {false, true}) {
    SCOPED_TRACE(strided ? "per-tensor path" : "fused path");
    auto g0 = at::detail::createCPUGenerator(21);
    const auto values = at::randn({70001}, g0);
    auto ours = strided ? strided_copy(values) : values.clone();
    ASSERT_EQ(ours.is_contiguous(), !strided);
    ours.requires_grad_();
    auto theirs = values.clone().requires_grad_();
    aopt::SGD opt({ours}, aopt::SGDOptions(0.05).dampening(0.5).weight_decay(1e-2));
    torch::optim::SGD ref({theirs},
                          torch::optim::SGDOptions(0.05).dampening(0.5).weight_decay(1e-2));
    for (int s = 0; s < 10; ++s) {
      if (s == 3) {
        static_cast<aopt::SGDOptions&>(opt.param_groups()[0].options()).momentum(0.9);
        static_cast<torch::optim::SGDOptions&>(ref.param_groups()[0].options()).momentum(0.9);
      }
      auto g = at::detail::createCPUGenerator(300 + s);
      const auto grad = at::randn({70001}, g);
      ours.mutable_grad() = strided ? strided_copy(grad) : grad.clone();
      theirs.mutable_grad() = grad.clone();
      opt.step();
      ref.step();
    }
    EXPECT_LE((ours.detach() - theirs.detach()).abs().max().item<double>(), kFp32Tol);
    EXPECT_EQ(opt.step_count(ours), 10);
  }
}

// LAMB's trust ratio is 1 where the param or its update is all zeros, as in
// PyTorch-style LAMB: a zero-initialised bias moves at its first step (a
// ratio of 0 would hold it at zero for good), and a param whose gradient and
// weight decay are zero stays as it is (0 / 0 would make it NaN). Both paths.
TEST(OptimTest, LAMBTrustRatioIsOneWhereTheParamOrItsUpdateIsZero) {
  for (const bool strided : {false, true}) {
    SCOPED_TRACE(strided ? "per-tensor path" : "fused path");
    auto g0 = at::detail::createCPUGenerator(22);
    const auto frozen_values = at::randn({37}, g0);
    auto bias = strided ? strided_copy(at::zeros({37})) : at::zeros({37});
    auto frozen = strided ? strided_copy(frozen_values) : frozen_values.clone();
    bias.requires_grad_();
    frozen.requires_grad_();
    Reference ref{Algo::kLamb};
    ref.wd = 0;
    ref.w = torch::zeros({37}, torch::kDouble);
    aopt::LAMB opt({bias, frozen}, aopt::LAMBOptions(ref.lr).eps(ref.eps).weight_decay(0));
    for (int s = 0; s < 5; ++s) {
      auto g = at::detail::createCPUGenerator(400 + s);
      const auto grad = at::randn({37}, g);
      bias.mutable_grad() = strided ? strided_copy(grad) : grad.clone();
      frozen.mutable_grad() = strided ? strided_copy(at::zeros({37})) : at::zeros({37});
      ref.update(grad.to(torch::kDouble));
      opt.step();
    }
    EXPECT_GT(bias.detach().abs().min().item<double>(), 0);
    EXPECT_LE((bias.detach().to(torch::kDouble) - ref.w).abs().max().item<double>(), 2e-6);
    EXPECT_TRUE(torch::equal(frozen.detach(), frozen_values));
  }
}

TEST(OptimTest, LAMBFollowsDoubleReferenceOnFp32) {
  auto g0 = at::detail::createCPUGenerator(11);
  auto p = at::randn({300, 7}, g0).requires_grad_();
  Reference ref{Algo::kLamb};
  ref.eps = 1e-6;
  ref.w = p.detach().to(torch::kDouble);
  aopt::LAMB opt({p}, aopt::LAMBOptions(ref.lr).weight_decay(ref.wd));
  for (int s = 0; s < 30; ++s) {
    auto g = at::detail::createCPUGenerator(50 + s);
    p.mutable_grad() = at::randn({300, 7}, g);
    ref.update(p.grad().to(torch::kDouble));
    opt.step();
  }
  EXPECT_FALSE(opt.master(p).defined());  // fp32: its own master
  EXPECT_LE((p.detach().to(torch::kDouble) - ref.w).abs().max().item<double>(), 2e-6);
}

TEST(OptimTest, StepResultsDoNotDependOnThreadCount) {
  std::vector<torch::Tensor> finals;
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    auto g0 = at::detail::createCPUGenerator(12);
    auto p = at::randn({300000}, g0).to(torch::kBFloat16).requires_grad_();
    aopt::LAMB opt({p});
    for (int s = 0; s < 3; ++s) {
      auto g = at::detail::createCPUGenerator(60 + s);
      p.mutable_grad() = at::randn({300000}, g).to(torch::kBFloat16);
      opt.step();
    }
    finals.push_back(opt.master(p).clone());
  }
  at::set_num_threads(1);
  EXPECT_TRUE(torch::equal(finals[0], finals[1]));
}

TEST(OptimTest, NonContiguousParamsTakeTheATenPath) {
  auto g0 = at::detail::createCPUGenerator(13);
  auto base = at::randn({6, 40}, g0);
  auto a = base.clone().t().requires_grad_();  // non-contiguous leaf: ATen-op path
  auto b = base.clone().t().contiguous().requires_grad_();
  ASSERT_FALSE(a.is_contiguous());
  aopt::AdamW oa({a}, aopt::AdamWOptions(1e-2));
  aopt::AdamW ob({b}, aopt::AdamWOptions(1e-2));
  for (int s = 0; s < 10; ++s) {
    auto g = at::detail::createCPUGenerator(70 + s);
    const auto grad = at::randn({40, 6}, g);
    a.mutable_grad() = grad.t().contiguous().t();
    b.mutable_grad() = grad.clone();
    oa.step();
    ob.step();
  }
  EXPECT_LE((a.detach() - b.detach()).abs().max().item<double>(), 1e-6);
  EXPECT_EQ(oa.step_count(a), 10);
}

// The fused kernels write the weights through data pointers. A step between
// a forward and its backward must still make the backward refuse, as
// torch::optim's in-place ops do, instead of differentiating with the new
// weights: the step counts its write in each param's version.
TEST(OptimTest, FusedStepsCountTheirWriteInTheParamsVersion) {
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    torch::manual_seed(3);
    auto w = torch::randn({8, 8}).to(dtype).requires_grad_();
    aopt::SGD opt({w}, aopt::SGDOptions(0.1));
    w.mutable_grad() = torch::ones_like(w);
    const auto before = w._version();
    opt.step();
    EXPECT_EQ(w._version(), before + 1);

    auto loss = w.pow(3).sum();  // saves w for the backward
    opt.step();
    EXPECT_THROW(loss.backward(), c10::Error);
  }
}

// --- capture_master_weights + in-place cast ------------------------------------

TEST(OptimTest, CapturedMastersKeepTheFp32ValuesThroughTheCast) {
  auto net = make_net(14);
  aopt::AdamW opt(net->parameters(), aopt::AdamWOptions(1e-3).weight_decay(0));
  opt.capture_master_weights();
  const auto original = snapshot(net->parameters());
  for (auto& p : net->parameters()) p.set_data(p.detach().to(torch::kBFloat16));
  const auto b = make_batch(1);
  torch::mse_loss(net->forward(b.x), b.y).backward();
  opt.step();
  int64_t differs_from_rounded = 0, total = 0;
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto g = params[i].grad().to(torch::kDouble);
    // First Adam step: m_hat = g, v_hat = g^2.
    const auto update = 1e-3 * g / (g.abs() + 1e-8);
    const auto expect = original[i].to(torch::kDouble) - update;
    const auto master = opt.master(params[i]).to(torch::kDouble);
    EXPECT_LE((master - expect).abs().max().item<double>(), 1e-7) << "param " << i;
    const auto from_rounded = original[i].to(torch::kBFloat16).to(torch::kDouble) - update;
    differs_from_rounded += (master - from_rounded).abs().gt(1e-7).sum().item<int64_t>();
    total += master.numel();
    EXPECT_TRUE(torch::equal(params[i].detach(), opt.master(params[i]).to(torch::kBFloat16)));
  }
  EXPECT_GT(differs_from_rounded, total / 2);
}

TEST(OptimTest, Fp32ParamsDropCapturedMastersAndUncapturedOnesGetOne) {
  auto net = make_net(15);
  aopt::SGD opt(net->parameters(), aopt::SGDOptions(0.1));
  opt.capture_master_weights();
  auto params = net->parameters();
  params[0].set_data(params[0].detach().to(torch::kBFloat16));  // only the first is cast
  for (auto& p : params) p.mutable_grad() = torch::ones_like(p);
  opt.step();
  EXPECT_TRUE(opt.master(params[0]).defined());
  for (size_t i = 1; i < params.size(); ++i) EXPECT_FALSE(opt.master(params[i]).defined());
  // Cast after construction without capture: master made from the bf16 value.
  auto p = torch::ones({4}, torch::kBFloat16).requires_grad_();
  aopt::SGD o2({p}, aopt::SGDOptions(0.5));
  p.mutable_grad() = torch::full({4}, 0.25, torch::kBFloat16);
  o2.step();
  EXPECT_TRUE(torch::equal(o2.master(p), torch::full({4}, 0.875)));
  EXPECT_EQ(aopt::master_weights(o2)[0].data_ptr(), o2.master(p).data_ptr());
  EXPECT_TRUE(aopt::model_params(o2)[0].is_same(p));
}

}  // namespace
