// ampx::optim's fused steps (src/optim/fused/): the CPU kernels round as the
// per-tensor path of ATen ops does, op for op; on CUDA, the ATen-op path
// matches the CPU and skips without a host sync, and the fused CUDA step is
// the CPU kernels' bits, the same on every run, never waits for the device
// and replays in a CUDA graph (skipped without a GPU).

#include "ampx/detail/cpu_isa.h"
#include "ampx/optim.h"

#include "../test_util.h"

#include <torch/torch.h>

#if defined(AMPX_TESTS_WITH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

using ampx::test::full_state;
using ampx::test::same_bits;
using ampx::test::strided_copy;
namespace aopt = ampx::optim;

// --- CUDA (ATen-op path, no host sync) ----------------------------------------------

TEST(OptimTest, CudaMatchesCpuAndSkipsWithoutSync) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
  auto g0 = at::detail::createCPUGenerator(70);
  const auto init = at::randn({1000}, g0);
  auto cpu_p = init.to(torch::kBFloat16).requires_grad_();
  auto cuda_p = init.to(torch::kBFloat16).to(torch::kCUDA).requires_grad_();
  aopt::AdamW cpu_opt({cpu_p}, aopt::AdamWOptions(1e-2));
  aopt::AdamW cuda_opt({cuda_p}, aopt::AdamWOptions(1e-2));
  for (int s = 0; s < 10; ++s) {
    auto g = at::detail::createCPUGenerator(80 + s);
    const auto grad = at::randn({1000}, g).to(torch::kBFloat16);
    cpu_p.mutable_grad() = grad * 1024;
    cuda_p.mutable_grad() = (grad * 1024).to(torch::kCUDA);
    const auto scale = torch::full({}, 1024.f);
    const auto found = torch::full({}, s == 4 ? 1.f : 0.f);
    cpu_opt.step_scaled(scale, found);
    cuda_opt.step_scaled(scale.cuda(), found.cuda());
  }
  EXPECT_EQ(cuda_opt.step_count(cuda_p), 9);
  EXPECT_LE((cuda_opt.master(cuda_p).cpu() - cpu_opt.master(cpu_p)).abs().max().item<double>(),
            1e-5);
}

// --- The fused CUDA step (src/optim/fused/cuda_step.cu): the arithmetic of the
// CPU kernels (src/optim/fused/optim_math.h) on the GPU, a few launches per step.

struct FusedCudaCase {
  const char* optimizer;  // adamw, sgd, lamb
  torch::ScalarType dtype;
  bool masters;
  bool stochastic_rounding;
  aopt::StateFormat state = aopt::StateFormat::kFp32;  // the moments (tiles where not fp32)
  bool kahan = false;                                  // Kahan weights (tiles)
  int64_t state_block = 256;
};

std::string case_name(const FusedCudaCase& c) {
  std::ostringstream s;
  s << c.optimizer << " " << c.dtype << (c.masters ? " with masters" : " without masters")
    << (c.stochastic_rounding ? ", stochastic rounding" : "") << (c.kahan ? ", Kahan" : "") << ", "
    << aopt::state_format_name(c.state) << " moments (block " << c.state_block << ")";
  return s.str();
}

/// Whether the case's steps run in the fused steps' tiles.
bool tiled(const FusedCudaCase& c) {
  return c.state != aopt::StateFormat::kFp32 || c.kahan;
}

std::unique_ptr<aopt::MixedPrecisionOptimizer> make_optimizer(const FusedCudaCase& c,
                                                              std::vector<torch::Tensor> params) {
  const std::string name = c.optimizer;
  if (name == "adamw") {
    return std::make_unique<aopt::AdamW>(params, aopt::AdamWOptions(1e-2)
                                                     .weight_decay(0.1)
                                                     .master_weights(c.masters)
                                                     .stochastic_rounding(c.stochastic_rounding)
                                                     .kahan_summation(c.kahan)
                                                     .state_format(c.state)
                                                     .state_block(c.state_block)
                                                     .seed(7));
  }
  if (name == "sgd") {
    return std::make_unique<aopt::SGD>(params, aopt::SGDOptions(0.05)
                                                   .momentum(0.9)
                                                   .nesterov(true)
                                                   .weight_decay(1e-3)
                                                   .master_weights(c.masters)
                                                   .stochastic_rounding(c.stochastic_rounding)
                                                   .kahan_summation(c.kahan)
                                                   .state_format(c.state)
                                                   .state_block(c.state_block)
                                                   .seed(7));
  }
  return std::make_unique<aopt::LAMB>(params, aopt::LAMBOptions(1e-2)
                                                  .master_weights(c.masters)
                                                  .stochastic_rounding(c.stochastic_rounding)
                                                  .kahan_summation(c.kahan)
                                                  .state_format(c.state)
                                                  .state_block(c.state_block)
                                                  .seed(7));
}

// Six scaled steps (scale 1024; the fourth has an inf and is skipped) on
// params of 70000 (two chunks), 300 and 17x5 elements; everything the
// optimizer holds afterwards, on the CPU. strided: every param is a stride-2
// view, which takes the per-tensor path of ATen ops instead of the kernels.
std::vector<torch::Tensor> fused_case_run(const FusedCudaCase& c, const torch::Device& device,
                                          bool strided = false) {
  auto gen = at::detail::createCPUGenerator(90);
  std::vector<torch::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{70000}, {300}, {17, 5}}) {
    auto values = at::randn(shape, gen).to(c.dtype).to(device);
    params.push_back((strided ? strided_copy(values) : values).requires_grad_());
  }
  auto opt = make_optimizer(c, params);
  for (int s = 0; s < 6; ++s) {
    auto g = at::detail::createCPUGenerator(100 + s);
    for (auto& p : params) {
      p.mutable_grad() = (at::randn(p.sizes(), g) * 1024).to(c.dtype).to(device);
    }
    opt->step_scaled(torch::full({}, 1024.f, torch::TensorOptions().device(device)),
                     torch::full({}, s == 3 ? 1.f : 0.f, torch::TensorOptions().device(device)));
  }
  std::vector<torch::Tensor> out;
  for (const auto& t : full_state(*opt)) out.push_back(t.defined() ? t.cpu() : t);
  // A Kahan compensation as the fp32 weight it makes with its param: LAMB's
  // trust ratios differ between the devices in the sixth digit (below),
  // which can move a param across a rounding point of its dtype and so its
  // compensation by a whole ulp of the param, while the weight the two make
  // moves by the ratio's difference alone. (full_state: the params, then
  // per param its master, compensation, moments and step count.)
  for (size_t k = 0; k < params.size(); ++k) {
    auto& compensation = out[params.size() + 5 * k + 1];
    if (compensation.defined()) {
      compensation = out[k].to(torch::kFloat) + compensation.to(torch::kFloat);
    }
  }
  return out;
}

const FusedCudaCase kFusedCudaCases[] = {
    {"adamw", torch::kFloat, true, false},
    {"adamw", torch::kBFloat16, true, false},
    {"adamw", torch::kHalf, true, false},
    {"adamw", torch::kBFloat16, false, true},
    {"sgd", torch::kFloat, true, false},
    {"sgd", torch::kBFloat16, true, false},
    {"sgd", torch::kHalf, true, false},
    {"sgd", torch::kBFloat16, false, true},
    {"lamb", torch::kFloat, true, false},
    {"lamb", torch::kBFloat16, true, false},
    {"lamb", torch::kHalf, true, false},
    {"lamb", torch::kBFloat16, false, true},
    // Coded moments and Kahan weights: the CPU's tiles on the GPU (70000
    // elements: a last block of 112, or of 368 in blocks of 4096).
    {"adamw", torch::kBFloat16, true, false, aopt::StateFormat::kBf16},
    {"adamw", torch::kBFloat16, false, false, aopt::StateFormat::kInt8, true},
    {"adamw", torch::kBFloat16, false, true, aopt::StateFormat::kFp8},
    {"adamw", torch::kHalf, false, false, aopt::StateFormat::kFp32, true},
    {"adamw", torch::kFloat, true, false, aopt::StateFormat::kInt8, false, 4096},
    {"sgd", torch::kBFloat16, false, false, aopt::StateFormat::kInt8, true},
    {"sgd", torch::kBFloat16, true, false, aopt::StateFormat::kFp8, false, 32},
    {"lamb", torch::kBFloat16, false, false, aopt::StateFormat::kInt8, true},
    {"lamb", torch::kBFloat16, false, true, aopt::StateFormat::kBf16},
    {"lamb", torch::kFloat, true, false, aopt::StateFormat::kFp8, false, 4096},
    {"lamb", torch::kHalf, false, false, aopt::StateFormat::kFp32, true}};

// The fused CPU kernels compute the per-tensor path's expressions, op for op
// and rounding for rounding: no multiply-add contracted into an FMA (which
// GCC does by default wherever the ISA build has FMA) and no operands
// reordered. The CUDA kernels promise the same (--fmad=false), so this is
// what lets the GPU's steps equal the CPU's. Not LAMB (its norms are sums in
// another order) nor stochastic rounding (the per-tensor path draws its bits
// elsewhere).
TEST(OptimTest, FusedCpuKernelsRoundAsThePerTensorPath) {
  for (const auto& c : kFusedCudaCases) {
    // (Nor the tiles: the per-tensor path refuses coded moments and Kahan weights.)
    if (std::string(c.optimizer) == "lamb" || c.stochastic_rounding || tiled(c)) continue;
    SCOPED_TRACE(case_name(c) + " on " +
                 ampx::detail::cpu::isa_name(ampx::detail::cpu::best_isa()));
    const auto fused = fused_case_run(c, torch::kCPU);
    const auto generic = fused_case_run(c, torch::kCPU, /*strided=*/true);
    ASSERT_EQ(fused.size(), generic.size());
    for (size_t i = 0; i < fused.size(); ++i) {
      ASSERT_EQ(fused[i].defined(), generic[i].defined()) << "tensor " << i;
      if (!fused[i].defined()) continue;
      EXPECT_TRUE(torch::equal(fused[i], generic[i]))
          << "tensor " << i << " (max |fused - per-tensor| "
          << (fused[i].to(torch::kDouble) - generic[i].to(torch::kDouble))
                 .abs()
                 .max()
                 .item<double>()
          << ")";
    }
  }
}

TEST(OptimTest, CudaFusedStepMatchesTheCpuKernels) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
  for (const auto& c : kFusedCudaCases) {
    SCOPED_TRACE(case_name(c));
    const auto cpu = fused_case_run(c, torch::kCPU);
    const auto gpu = fused_case_run(c, torch::kCUDA);
    ASSERT_EQ(cpu.size(), gpu.size());
    for (size_t i = 0; i < cpu.size(); ++i) {
      ASSERT_EQ(cpu[i].defined(), gpu[i].defined()) << "tensor " << i;
      if (!cpu[i].defined()) continue;
      ASSERT_EQ(cpu[i].scalar_type(), gpu[i].scalar_type()) << "tensor " << i;
      if (!cpu[i].is_floating_point()) {
        EXPECT_TRUE(torch::equal(cpu[i], gpu[i])) << "tensor " << i;  // step counts
        continue;
      }
      // The same expressions in the same order: equal, but for the odd libm
      // difference in a bias correction, which can move a value by an ulp of
      // its dtype (fp32: master and states; the param's own dtype), and for
      // LAMB's norms: fp32 sums of up to 70000 squares in another order (a
      // 512-thread tree per chunk on the GPU, 8 or 16 lanes on the CPU),
      // whose trust ratios differ in the sixth digit; over five steps that
      // moved fp32 masters by 4.8e-7 on 0.49 on the H100 machine's AVX-512
      // CPU. LAMB's fp32 tensors get 8 times the bound; a wrong term in its
      // update is off by far more.
      const bool lamb = std::string(c.optimizer) == "lamb";
      const double ulp = cpu[i].scalar_type() == torch::kBFloat16 ? 0x1p-7
                         : cpu[i].scalar_type() == torch::kHalf   ? 0x1p-10
                         : lamb                                   ? 0x1p-17
                                                                  : 0x1p-20;
      const auto a = cpu[i].to(torch::kDouble), b = gpu[i].to(torch::kDouble);
      const auto excess = ((a - b).abs() - ulp * a.abs().clamp_min(1e-3)).max().item<double>();
      EXPECT_LE(excess, 0.0) << "tensor " << i << " (max |cpu - gpu| "
                             << (a - b).abs().max().item<double>() << ")";
    }
  }
}

TEST(OptimTest, CudaFusedStepIsTheSameBitsOnEveryRun) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
  for (const auto& c : kFusedCudaCases) {
    SCOPED_TRACE(case_name(c));
    EXPECT_TRUE(same_bits(fused_case_run(c, torch::kCUDA), fused_case_run(c, torch::kCUDA)));
  }
}

TEST(OptimTest, CudaFusedStepNeverWaitsForTheDevice) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
#if defined(AMPX_TESTS_WITH_CUDA)
  const auto dev = torch::TensorOptions().device(torch::kCUDA);
  auto gen = at::detail::createCPUGenerator(3);
  std::vector<torch::Tensor> params;
  for (int64_t n : {100000, 10, 4096}) {
    params.push_back(at::randn({n}, gen).to(torch::kBFloat16).cuda().requires_grad_());
  }
  for (const auto& c : kFusedCudaCases) {
    if (c.dtype != torch::kBFloat16) continue;
    SCOPED_TRACE(case_name(c));
    auto opt = make_optimizer(c, params);
    for (auto& p : params) p.mutable_grad() = torch::ones_like(p);
    const auto scale = torch::full({}, 1024.f, dev), found = torch::zeros({}, dev);
    // LibTorch's sync debug mode throws on any synchronising call (an item(),
    // a device-to-host copy, a stream synchronisation) while it is on.
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
    try {
      for (int s = 0; s < 3; ++s) opt->step_scaled(scale, found);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "the step synchronised: " << e.what();
    }
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    EXPECT_EQ(opt->step_count(params[0]), 3);
  }
#else
  GTEST_SKIP() << "ampx_tests built without CUDA";
#endif
}

TEST(OptimTest, CudaFusedStepReplaysInACudaGraphAsEagerSteps) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA not available";
  }
#if defined(AMPX_TESTS_WITH_CUDA)
  const auto dev = torch::TensorOptions().device(torch::kCUDA);
  for (const auto& c : kFusedCudaCases) {
    SCOPED_TRACE(case_name(c));
    // Two optimizers over equal params and grads: one steps eagerly, the
    // other's step is captured once and replayed.
    auto make_params = [&] {
      auto gen = at::detail::createCPUGenerator(11);
      std::vector<torch::Tensor> params;
      for (int64_t n : {70000, 300}) {
        auto p = at::randn({n}, gen).to(c.dtype).cuda().requires_grad_();
        p.mutable_grad() = (at::randn({n}, gen) * 512).to(c.dtype).cuda();
        params.push_back(p);
      }
      return params;
    };
    auto eager_params = make_params(), graph_params = make_params();
    auto eager = make_optimizer(c, eager_params), captured = make_optimizer(c, graph_params);
    const auto scale = torch::full({}, 512.f, dev), found = torch::zeros({}, dev);
    constexpr int kWarmup = 3, kReplays = 4;
    for (int s = 0; s < kWarmup + kReplays; ++s) eager->step_scaled(scale, found);

    // A side stream, ordered after (and later before) the current one.
    auto side = at::cuda::getStreamFromPool();
    auto order = [](const c10::cuda::CUDAStream& first, const c10::cuda::CUDAStream& then) {
      at::cuda::CUDAEvent done;
      done.record(first);
      done.block(then);
    };
    order(at::cuda::getCurrentCUDAStream(), side);
    {
      const c10::cuda::CUDAStreamGuard guard(side);
      for (int s = 0; s < kWarmup; ++s) captured->step_scaled(scale, found);
    }
    order(side, at::cuda::getCurrentCUDAStream());
    torch::cuda::synchronize();
    at::cuda::CUDAGraph graph;
    {
      const c10::cuda::CUDAStreamGuard guard(side);
      graph.capture_begin();
      captured->step_scaled(scale, found);  // recorded, not run
      graph.capture_end();
    }
    for (int r = 0; r < kReplays; ++r) graph.replay();
    torch::cuda::synchronize();
    EXPECT_TRUE(same_bits(full_state(*eager), full_state(*captured)));
  }
#else
  GTEST_SKIP() << "ampx_tests built without CUDA";
#endif
}

}  // namespace
