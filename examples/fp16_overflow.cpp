// The numerics tools on a model that overflows in float16: read the
// advisor's verdict from a float32 run, find the op that makes the first
// inf, and fix it as the advice says (docs/examples.md walks through it).
//
//   fp16_overflow
//
// The model's middle layer ("big") makes activations near 1e6, past fp16's
// 65504, and the next op scales them back, so float32 trains it fine. The
// program exits 1 unless the advisor, from four float32 steps, says fp16
// overflows in "big" and recommends bfloat16; the NonFiniteGuard, on a
// float16 step (where this LibTorch has CPU float16 autocast, 2.x; 1.13's
// AutocastGuard refuses float16 on the CPU, and the step is left out),
// names "big" as the scope of the first inf; and training in bfloat16, as
// advised, stays finite.

#include <ampx/ampx.h>
#include <ampx/debug.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>

namespace {

constexpr double kBig = 1e6;  // how far "big" lifts its activations

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 64));
    big = register_module("big", torch::nn::Linear(64, 64));
    head = register_module("head", torch::nn::Linear(64, 1));
    torch::NoGradGuard no_grad;
    big->weight.mul_(kBig);  // float32's range, not float16's
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(big(torch::relu(fc1(x))) * (1.0 / kBig));  // back to unit scale
  }
  torch::nn::Linear fc1{nullptr}, big{nullptr}, head{nullptr};
};
TORCH_MODULE(Net);

// One training step, in `dtype` under autocast (float32: none); its loss.
double step(Net& net, torch::optim::Optimizer& opt, int64_t i, c10::ScalarType dtype) {
  torch::manual_seed(100 + i);
  const auto x = torch::randn({64, 16});
  const auto y = x.slice(1, 0, 1).sin();
  opt.zero_grad();
  torch::Tensor loss;
  {
    std::optional<ampx::AutocastGuard> autocast;
    if (dtype != torch::kFloat) autocast.emplace(torch::kCPU, dtype);
    loss = torch::mse_loss(net->forward(x), y);
  }
  loss.backward();
  opt.step();
  return loss.item<double>();
}

}  // namespace

int main() {
  namespace debug = ampx::debug;
  bool ok = true;
  torch::manual_seed(0);
  Net net;
  debug::name_modules(*net);  // ops that take big's weight run in scope "big"
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(1e-3));

  // 1. The advisor, from the value ranges of four float32 steps.
  debug::PrecisionAdvice advice;
  {
    debug::RangeStatsCollector collector;
    for (int64_t i = 0; i < 4; ++i) step(net, opt, i, torch::kFloat);
    advice = debug::advise(collector.stats());
  }
  const std::string report = advice.to_markdown();
  std::printf("%s\n", report.c_str());
  const bool fp16_overflows = advice.verdict(debug::Format::kFloat16) == debug::Verdict::kOverflows;
  const bool names_big = report.find("big") != std::string::npos;
  const bool says_bf16 = advice.recommended == debug::Format::kBFloat16;
  std::printf("advisor: fp16 %s, names \"big\": %s, recommends %s\n",
              debug::to_string(advice.verdict(debug::Format::kFloat16)).c_str(),
              names_big ? "yes" : "no", says_bf16 ? "bf16" : "another format");
  ok = ok && fp16_overflows && names_big && says_bf16;

  // 2. The op: one float16 step under a NonFiniteGuard, which throws from the
  // op that makes the first inf, naming it and its scope.
  std::string scope, refused;
  try {
    debug::NonFiniteGuard guard(debug::NonFiniteOptions().step(4));
    step(net, opt, 4, torch::kHalf);
  } catch (const debug::NonFiniteError& e) {
    scope = e.report().scope;
    std::printf("NonFiniteGuard: %s\n", e.report().message().c_str());
  } catch (const c10::ValueError& e) {  // LibTorch 1.13: CPU autocast is bfloat16 only
    refused = e.what_without_backtrace();
  }
  if (refused.empty()) {
    std::printf("the first inf in float16: scope \"%s\"\n", scope.c_str());
    ok = ok && scope == "big";
  } else {
    std::printf("(no float16 step here: %s)\n", refused.c_str());
  }

  // 3. The fix the advice gives: bfloat16, float32's range in 16 bits.
  double last = 0;
  for (int64_t i = 5; i < 15; ++i) last = step(net, opt, i, torch::kBFloat16);
  std::printf("bfloat16, as advised: 10 steps, last loss %.4f\n", last);
  ok = ok && std::isfinite(last);

  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
