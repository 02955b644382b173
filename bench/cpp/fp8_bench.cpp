// FP8 Linear against bf16 on the matrix shapes of a GPT-2-small block
// (d 768: qkv 768->2304, proj 768->768, fc 768->3072, out 3072->768) and, on
// CUDA (or with --wide), square layers 4096 and 8192 wide; one forward and
// backward per iteration, median of the timed iterations:
//
//   build/host/bench/ampx_fp8_bench [--device cuda|cpu] [--tokens N] [--iters N]
//                                   [--wide 0|1] [--profile TRACE.json]
//
// Each FP8 row has its breakdown, each part timed alone on the same tensors:
// cast_ms, the three casts of a step (input and weight with their
// transposes, output gradient; on CUDA one kernel each, cast_kernels.cu);
// scaling_ms, the three delayed-scaling updates; rest_ms, fp8_ms less both
// (the products, the bias and autograd's own work).
//
// fp8_kept_ms: the same FP8 forward + backward with the weight's codes kept
// from a first micro-batch (WeightCasts::kLaterMicroBatch), as a step's later
// micro-batches run under gradient accumulation; kept_speedup, bf16 over it.
//
// --profile: after the timing, three more forward + backward passes of the
// FP8 block (each layer once) under LibTorch's Kineto profiler, CPU ops and,
// on CUDA, the GPU's kernels and runtime calls: a Chrome trace for
// scripts/fp8_profile.py (where an FP8 layer's time goes).
//
// block_casts: the block-scaled casts of ampx/fp8/block.h on the same device
// (on CUDA src/fp8/block/cuda/block_kernels.cu), each timed alone on a [tokens, 3072]
// bf16 tensor (an fc layer's output gradient), median ms: MXFP8 1 x 32 and
// 32 x 1 (the column-wise copy), NVFP4 1 x 16, 16 x 16 and stochastic
// 16 x 1 (the weight gradient's operand), FP8 blockwise 1 x 128; MXFP8's
// dequantize, and hadamard16 down the tokens.
//
// On CUDA with LibTorch 2.5+ on Hopper/Ada the FP8 products run on tensor
// cores (at::_scaled_mm; the JSON says how many did); elsewhere they are the
// float32 emulation, whose time is the cost of checking numerics, not a speed.
// Prints one JSON object.

#include <ampx/ampx.h>

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <set>
#include <string>
#include <vector>

namespace {

void sync(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize();
}

// Median ms of `fn` over `iters` runs after 3 of warm-up, the device synchronised around each.
template <class Fn>
double time_ms(Fn&& fn, int iters, const torch::Device& device) {
  std::vector<double> ms;
  for (int i = 0; i < iters + 3; ++i) {
    sync(device);
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    sync(device);
    const double t =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (i >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Median ms of one forward + backward of `linear` on x, in bf16 autocast or
// FP8 with `casts` (kLaterMicroBatch: the weight's codes kept by a first
// micro-batch, the first warm-up run, as in a step's later micro-batches).
double time_linear(torch::nn::Linear& linear, const torch::Tensor& x, bool fp8, int iters,
                   const torch::Device& device,
                   ampx::fp8::WeightCasts casts = ampx::fp8::WeightCasts::kEveryForward) {
  const auto g = torch::randn({x.size(0), linear->options.out_features()},
                              x.options().dtype(torch::kBFloat16));
  bool first = casts == ampx::fp8::WeightCasts::kLaterMicroBatch;
  return time_ms(
      [&] {
        ampx::AutocastGuard autocast(device.type(), torch::kBFloat16);
        ampx::fp8::Fp8AutocastGuard region(
            ampx::fp8::Fp8AutocastOptions().enabled(fp8).weight_casts(
                first ? ampx::fp8::WeightCasts::kFirstMicroBatch : casts));
        first = false;
        auto y = linear->forward(x);
        y.backward(g.to(y.scalar_type()));
      },
      iters, device);
}

struct Breakdown {
  double cast_ms, scaling_ms;
};

// The casts and the scaling updates of one FP8 step of an in x out layer on
// `tokens` rows, each timed alone: the input and the weight (with their
// transposes), the output gradient; then three delayed-scaling updates.
Breakdown fp8_breakdown(int64_t tokens, int64_t in, int64_t out, int iters,
                        const torch::Device& device) {
  using ampx::fp8::TensorScaling;
  const auto bf16 = torch::TensorOptions().device(device).dtype(torch::kBFloat16);
  const auto x = torch::randn({tokens, in}, bf16), g = torch::randn({tokens, out}, bf16);
  const auto w = torch::randn({out, in}, torch::TensorOptions().device(device));
  const ampx::fp8::Recipe recipe;  // delayed scaling, TE's defaults
  auto input = std::make_shared<TensorScaling>(recipe, ampx::Direction::kForward, device);
  auto weight = std::make_shared<TensorScaling>(recipe, ampx::Direction::kForward, device);
  auto grad = std::make_shared<TensorScaling>(recipe, ampx::Direction::kBackward, device);
  const double cast_ms = time_ms(
      [&] {
        at::Tensor t;
        (void)input->cast(x, /*record=*/false, nullptr, &t);
        (void)weight->cast(w, /*record=*/false, nullptr, &t);
        (void)grad->cast(g, /*record=*/false, nullptr, &t);
      },
      iters, device);
  const auto amax = torch::full({1}, 3.0f, torch::TensorOptions().device(device));
  const double scaling_ms = time_ms(
      [&] {
        for (auto* role : {input.get(), weight.get(), grad.get()}) role->delayed_state().update(amax);
      },
      iters, device);
  return {cast_ms, scaling_ms};
}

// `passes` forward + backward passes of every layer of `block` in FP8 under
// the Kineto profiler, written as a Chrome trace to `path`.
void profile_block(std::vector<torch::nn::Linear>& block, const std::vector<torch::Tensor>& inputs,
                   int passes, const torch::Device& device, const std::string& path) {
  namespace prof = torch::autograd::profiler;
  namespace impl = torch::profiler::impl;
  std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  if (device.is_cuda()) activities.insert(impl::ActivityType::CUDA);
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO, /*report_input_shapes=*/true);
  prof::prepareProfiler(config, activities);
  sync(device);
  prof::enableProfiler(config, activities);
  for (int p = 0; p < passes; ++p) {
    for (size_t s = 0; s < block.size(); ++s) {
      ampx::AutocastGuard autocast(device.type(), torch::kBFloat16);
      ampx::fp8::Fp8AutocastGuard region(true);
      auto y = block[s]->forward(inputs[s]);
      y.backward(torch::ones_like(y));
    }
  }
  sync(device);
  prof::disableProfiler()->save(path);
}

// The block_casts entries of the JSON (the header's list).
void print_block_casts(int64_t tokens, int iters, const torch::Device& device) {
  using ampx::fp8::BlockFormat;
  using ampx::fp8::BlockTensor;
  torch::manual_seed(0);
  const auto g = torch::randn({tokens, 3072}, torch::TensorOptions().device(device))
                     .to(torch::kBFloat16);
  struct Cast {
    const char* name;
    BlockFormat format;
    bool stochastic;
  };
  const Cast casts[] = {
      {"mxfp8 1x32", BlockFormat::mxfp8(), false},
      {"mxfp8 32x1", BlockFormat::mxfp8().block_rows(32).block_cols(1), false},
      {"nvfp4 1x16", BlockFormat::nvfp4(), false},
      {"nvfp4 16x16", BlockFormat::nvfp4().block_rows(16), false},
      {"nvfp4 16x1 stochastic", BlockFormat::nvfp4().block_rows(16).block_cols(1), true},
      {"fp8-block 1x128", BlockFormat::fp8_blockwise(), false}};
  std::printf(", \"block_casts\": [");
  for (size_t i = 0; i < std::size(casts); ++i) {
    const Cast& c = casts[i];
    const auto sr = c.stochastic ? c10::optional<ampx::fp8::StochasticRounding>(
                                       ampx::fp8::StochasticRounding{1, 0})
                                 : c10::nullopt;
    const auto cast = [&] { (void)BlockTensor::quantize(g, c.format, sr); };
    const double ms = time_ms(cast, iters, device);
    std::printf("%s{\"name\": \"%s\", \"quantize_ms\": %.4f}", i ? ", " : "", c.name, ms);
  }
  const auto mx = BlockTensor::quantize(g, BlockFormat::mxfp8());
  std::printf(", {\"name\": \"mxfp8 dequantize\", \"ms\": %.4f}",
              time_ms([&] { (void)mx.dequantize(torch::kBFloat16); }, iters, device));
  std::printf(", {\"name\": \"hadamard16 tokens\", \"ms\": %.4f}]",
              time_ms([&] { (void)ampx::fp8::hadamard16(g, false, 0); }, iters, device));
}

}  // namespace

int main(int argc, char** argv) {
  std::string device_name = torch::cuda::is_available() ? "cuda" : "cpu";
  int64_t tokens = 0;
  int iters = 20;
  std::string profile;
  int wide = -1;  // unset: on CUDA only
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--device")) device_name = argv[i + 1];
    if (!std::strcmp(argv[i], "--tokens")) tokens = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--profile")) profile = argv[i + 1];
    if (!std::strcmp(argv[i], "--wide")) wide = std::atoi(argv[i + 1]);
  }
  const torch::Device device(device_name == "cuda" ? torch::kCUDA : torch::kCPU);
  if (tokens == 0) tokens = device.is_cuda() ? 8 * 1024 : 512;  // batch 8 x context 1024
  struct Shape {
    const char* name;
    int64_t in, out;
  };
  std::vector<Shape> shapes = {
      {"qkv", 768, 2304}, {"proj", 768, 768}, {"fc", 768, 3072}, {"out", 3072, 768}};
  if (wide == 1 || (wide == -1 && device.is_cuda())) {
    shapes.push_back({"4096", 4096, 4096});
    shapes.push_back({"8192", 8192, 8192});
  }
  const size_t block_shapes = 4;  // the GPT-2-small block's: block_speedup and --profile
  std::printf("{\"device\": \"%s\", \"torch\": \"%s\", \"tokens\": %lld, \"shapes\": [",
              device_name.c_str(), ampx::torch_version(), static_cast<long long>(tokens));
  double total_bf16 = 0, total_fp8 = 0;
  const int64_t calls_before = ampx::fp8::detail::scaled_mm_calls();
  std::vector<torch::nn::Linear> fp8_block;
  std::vector<torch::Tensor> fp8_inputs;
  for (size_t s = 0; s < shapes.size(); ++s) {
    torch::manual_seed(0);
    torch::nn::Linear bf16(shapes[s].in, shapes[s].out), fp8(shapes[s].in, shapes[s].out);
    bf16->to(device);
    fp8->to(device);
    ampx::fp8::convert_linears(*fp8);
    const auto x = torch::randn({tokens, shapes[s].in}, torch::TensorOptions().device(device))
                       .to(torch::kBFloat16)
                       .requires_grad_(true);
    const double a = time_linear(bf16, x, false, iters, device);
    const double b = time_linear(fp8, x, true, iters, device);
    const double kept =
        time_linear(fp8, x, true, iters, device, ampx::fp8::WeightCasts::kLaterMicroBatch);
    const Breakdown parts = fp8_breakdown(tokens, shapes[s].in, shapes[s].out, iters, device);
    if (s < block_shapes) {
      total_bf16 += a;
      total_fp8 += b;
      fp8_block.push_back(fp8);
      fp8_inputs.push_back(x);
    }
    const double flops = 6.0 * tokens * shapes[s].in * shapes[s].out;  // fwd + 2 bwd products
    std::printf(
        "%s{\"name\": \"%s\", \"in\": %lld, \"out\": %lld, \"bf16_ms\": %.4f, "
        "\"fp8_ms\": %.4f, \"speedup\": %.3f, \"bf16_tflops\": %.2f, \"fp8_tflops\": %.2f, "
        "\"cast_ms\": %.4f, \"scaling_ms\": %.4f, \"rest_ms\": %.4f, \"fp8_kept_ms\": %.4f, "
        "\"kept_speedup\": %.3f}",
        s ? ", " : "", shapes[s].name, static_cast<long long>(shapes[s].in),
        static_cast<long long>(shapes[s].out), a, b, a / b, flops / a / 1e9, flops / b / 1e9,
        parts.cast_ms, parts.scaling_ms, b - parts.cast_ms - parts.scaling_ms, kept, a / kept);
    std::fflush(stdout);
  }
  std::printf("], \"block_speedup\": %.3f, \"scaled_mm_calls\": %lld", total_bf16 / total_fp8,
              static_cast<long long>(ampx::fp8::detail::scaled_mm_calls() - calls_before));
  print_block_casts(tokens, iters, device);
  std::printf("}\n");
  std::fflush(stdout);
  if (!profile.empty()) {
    try {
      profile_block(fp8_block, fp8_inputs, 3, device, profile);
    } catch (const c10::Error& e) {  // a LibTorch built without Kineto (Debian's 1.13)
      std::fprintf(stderr, "ampx_fp8_bench: --profile '%s' failed: %s\n", profile.c_str(),
                   e.what_without_backtrace());
      return 1;
    }
  }
  return 0;
}
