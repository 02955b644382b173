// Peak training memory of a transformer, fp32 vs O2 (bf16 params and
// activations, fp32 norms, fp32 masters and AdamW states), measured from
// allocated tensor bytes (ampx's tracking CPU allocator), in one run:
//
//   build/host/bench/ampx_o2_memory [--batch B] [--block T] [--layers L] [--d D]
//
// Each mode builds the model and optimizer, trains 3 steps (optimizer state
// exists from step 1), and reports the peak over those steps of everything
// allocated: weights, grads, masters, states, activations, temporaries.

#include "models.h"

#include <ampx/ampx.h>

#include <cstdio>
#include <cstring>
#include <string>

namespace {

struct Result {
  int64_t peak = 0;
  double loss = 0;
};

Result run(const std::string& mode, const ampx::train::GPTConfig& cfg, int64_t batch) {
  ampx::enable_cpu_memory_tracking();
  const auto base = ampx::cpu_memory_stats().allocated_bytes;
  ampx::reset_peak_cpu_memory();
  torch::manual_seed(0);
  auto tokens = torch::randint(cfg.vocab, {batch, cfg.block + 1});
  auto x = tokens.slice(1, 0, cfg.block), y = tokens.slice(1, 1);
  ampx::train::GPT gpt(cfg);
  Result r;
  if (mode == "fp32") {
    torch::optim::AdamW opt(gpt->parameters(), torch::optim::AdamWOptions(3e-4));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(gpt->forward(x).view({-1, cfg.vocab}),
                                                       y.reshape({-1}));
      loss.backward();
      opt.step();
      r.loss = loss.item<double>();
    }
  } else {
    ampx::optim::AdamW opt(gpt->parameters(), ampx::optim::AdamWOptions(3e-4));
    auto amp = ampx::initialize(
        gpt.ptr(), {&opt}, ampx::AmpOptions(ampx::OptLevel::O2).cast_model_outputs(torch::kFloat));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      torch::Tensor loss;
      {
        auto forward = amp.forward_guard();
        auto logits = amp.cast_output(gpt->forward(x));
        loss = torch::nn::functional::cross_entropy(logits.view({-1, cfg.vocab}), y.reshape({-1}));
      }
      amp.scaler().scale(loss).backward();
      amp.scaler().step(opt);
      amp.scaler().update();
      r.loss = loss.item<double>();
    }
  }
  r.peak = ampx::cpu_memory_stats().peak_allocated_bytes - base;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  ampx::train::GPTConfig cfg;
  cfg.block = 256;
  cfg.heads = 8;  // the shape docs/PERFORMANCE.md reports
  int64_t batch = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int64_t v = std::atoll(argv[i + 1]);
    if (k == "--batch")
      batch = v;
    else if (k == "--block")
      cfg.block = v;
    else if (k == "--layers")
      cfg.layers = v;
    else if (k == "--d")
      cfg.d = v;
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  at::set_num_threads(2);
  std::printf("GPT: %lld layers, d=%lld, %lld heads, block %lld, batch %lld; LibTorch %s\n",
              (long long)cfg.layers, (long long)cfg.d, (long long)cfg.heads, (long long)cfg.block,
              (long long)batch, ampx::torch_version());
  const auto fp32 = run("fp32", cfg, batch);
  const auto o2 = run("O2", cfg, batch);
  std::printf("%-6s %14s %10s\n", "mode", "peak MiB", "loss@3");
  std::printf("%-6s %14.1f %10.4f\n", "fp32", fp32.peak / 1048576.0, fp32.loss);
  std::printf("%-6s %14.1f %10.4f\n", "O2", o2.peak / 1048576.0, o2.loss);
  std::printf("O2 peak / fp32 peak = %.3f (reduction %.1f%%)\n", double(o2.peak) / fp32.peak,
              100.0 * (1.0 - double(o2.peak) / fp32.peak));
  return 0;
}
