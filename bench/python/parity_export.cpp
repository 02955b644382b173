// Exports what bench/python/parity_check.py needs to show that ampx_models.py
// is the model ampx-train trains: for each workload, the initial weights of
// the model built as ampx-train builds it (torch::manual_seed(seed), then the
// models.h constructor), a fixed batch, and what ampx-train's step computes on
// it in fp32 (O0) and in O1 (ampx's autocast, bf16): output, loss and grads.
//
//   ampx_parity_export OUT_DIR [--threads N]      (N: intra-op threads, default 1)
//   -> OUT_DIR/{gpt,mnist-cnn,fashion-mlp}.pt, each a dict for Python's
//      torch.load(path, weights_only=False) (torch::pickle_save's format):
//        "meta/<key>"    int64 scalars: seed, threads, batch, and for gpt
//                        vocab, block_size, layers, heads, d_model
//        "state/<name>"  named_parameters() and named_buffers(), before any step
//        "input", "target"
//        "fp32/output", "fp32/loss", "fp32/grad/<name>"   (O0)
//        "bf16/output", "bf16/loss", "bf16/grad/<name>"   (O1; output cast to fp32)

#include "gpt_nn.h"
#include "models.h"

#include <ampx/ampx.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <string>

namespace {

using ampx::train::FashionMLP;
using ampx::train::GPT;
using ampx::train::GPTConfig;
using ampx::train::GPTNN;
using ampx::train::MnistCNN;

constexpr uint64_t kSeed = 1337;  // ampx-train's --seed default

/// What Workload::build and Workload::forward are for one workload.
struct Net {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
};

/// workloads.cpp's loss: mean cross entropy over every position, in fp32.
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target) {
  const auto classes = logits.size(-1);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, classes}).to(torch::kFloat),
                                              target.reshape({-1}));
}

/// The model as train_mode() builds it: torch's global seed, then the constructor.
Net build(const std::string& workload, const GPTConfig& gpt) {
  torch::manual_seed(kSeed);
  if (workload == "gpt") {
    GPT m(gpt);
    return {m.ptr(), [m](const torch::Tensor& x) mutable { return m->forward(x); }};
  }
  if (workload == "gpt-nn") {
    GPTNN m(gpt);
    return {m.ptr(), [m](const torch::Tensor& x) mutable { return m->forward(x); }};
  }
  if (workload == "mnist-cnn") {
    MnistCNN m;
    return {m.ptr(), [m](const torch::Tensor& x) mutable { return m->forward(x); }};
  }
  FashionMLP m;
  return {m.ptr(), [m](const torch::Tensor& x) mutable { return m->forward(x); }};
}

struct StepResult {
  std::shared_ptr<torch::nn::Module> model;  // its params hold the grads
  torch::Tensor output;                      // fp32
  torch::Tensor loss;                        // fp32 scalar
};

/// Forward, loss and backward of trainer.cpp's step at `level` (O0: fp32;
/// O1: ampx's autocast in bf16, output cast to fp32), on a freshly built model.
StepResult run_step(const std::string& workload, const GPTConfig& gpt, ampx::OptLevel level,
                    const torch::Tensor& input, const torch::Tensor& target) {
  Net net = build(workload, gpt);
  net.module->train();
  ampx::optim::AdamW optimizer(net.module->parameters(),
                               ampx::optim::AdamWOptions(1e-3).weight_decay(0.01));
  ampx::AmpOptions options(level);
  if (level != ampx::OptLevel::O0) {
    options.dtype(torch::kBFloat16).cast_model_outputs(torch::kFloat);
  }
  ampx::AmpSession amp = ampx::initialize(net.module, {&optimizer}, options);
  optimizer.zero_grad();
  StepResult r;
  r.model = net.module;
  {
    auto forward = amp.forward_guard();
    r.output = amp.cast_output(net.forward(amp.cast_input(input)));
    r.loss = cross_entropy(r.output, target);
  }
  amp.scaler().scale(r.loss).backward();
  return r;
}

torch::Tensor scalar(int64_t v) {
  return torch::tensor(v, torch::kLong);
}

void export_workload(const std::string& workload, const std::filesystem::path& out, int threads) {
  // Small, fixed inputs from a generator of their own (the model's weights
  // come from the global one, as in ampx-train).
  auto gen = at::detail::createCPUGenerator(kSeed + 1);
  GPTConfig gpt;  // ampx-train's default shape; Moby Dick's vocabulary size
  gpt.vocab = 85;
  // The ops the Python model runs (its attention is explicit on the CPU).
  gpt.attention = ampx::train::GptAttention::kExplicit;
  c10::Dict<std::string, torch::Tensor> dict;
  torch::Tensor input, target;
  int64_t batch = 0;
  if (workload == "gpt" || workload == "gpt-nn") {
    batch = 4;
    auto tokens = torch::randint(gpt.vocab, {batch, gpt.block + 1}, gen, torch::kLong);
    input = tokens.slice(1, 0, gpt.block).contiguous();
    target = tokens.slice(1, 1).contiguous();
    dict.insert("meta/vocab", scalar(gpt.vocab));
    dict.insert("meta/block_size", scalar(gpt.block));
    dict.insert("meta/layers", scalar(gpt.layers));
    dict.insert("meta/heads", scalar(gpt.heads));
    dict.insert("meta/d_model", scalar(gpt.d));
  } else {
    batch = workload == "mnist-cnn" ? 16 : 32;
    auto images = torch::randn({batch, 28, 28}, gen);
    input = workload == "mnist-cnn" ? images.unsqueeze(1) : images.flatten(1);
    target = torch::randint(10, {batch}, gen, torch::kLong);
  }
  dict.insert("meta/seed", scalar(static_cast<int64_t>(kSeed)));
  dict.insert("meta/threads", scalar(threads));
  dict.insert("meta/batch", scalar(batch));
  dict.insert("input", input);
  dict.insert("target", target);

  // The initial state, from a model no forward pass has touched (batch norm
  // updates its running stats in train mode).
  {
    Net fresh = build(workload, gpt);
    for (const auto& p : fresh.module->named_parameters()) {
      dict.insert("state/" + p.key(), p.value().detach().clone());
    }
    for (const auto& b : fresh.module->named_buffers()) {
      dict.insert("state/" + b.key(), b.value().clone());
    }
  }
  const StepResult fp32 = run_step(workload, gpt, ampx::OptLevel::O0, input, target);
  const StepResult bf16 = run_step(workload, gpt, ampx::OptLevel::O1, input, target);
  TORCH_CHECK(bf16.output.scalar_type() == torch::kFloat, "ampx_parity_export: O1 output is ",
              bf16.output.scalar_type(), ", expected float (cast_model_outputs)");
  for (const auto* r : {&fp32, &bf16}) {
    const std::string prefix = r == &fp32 ? "fp32/" : "bf16/";
    dict.insert(prefix + "output", r->output.detach());
    dict.insert(prefix + "loss", r->loss.detach());
    for (const auto& p : r->model->named_parameters()) {  // fp32 grads: O1 keeps fp32 params
      dict.insert(prefix + "grad/" + p.key(), p.value().grad().clone());
    }
  }

  const std::vector<char> bytes = torch::pickle_save(dict);
  std::ofstream file(out, std::ios::binary);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(file.good(), "ampx_parity_export: cannot write '", out.string(), "'");
  std::cout << workload << ": fp32 loss " << fp32.loss.item<double>() << ", O1 bf16 loss "
            << bf16.loss.item<double>() << " -> " << out.string() << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc != 2 && !(argc == 4 && std::string(argv[2]) == "--threads")) {
      std::cerr << "usage: ampx_parity_export OUT_DIR [--threads N]\n";
      return 2;
    }
    const int threads = argc == 4 ? std::atoi(argv[3]) : 1;
    TORCH_CHECK(threads > 0, "ampx_parity_export: --threads must be > 0, got ", argv[3]);
    at::set_num_threads(threads);
    // The check is that the Python models are the C++ ones, bit for bit on
    // the same LibTorch: both multiply bf16 with LibTorch's kernels, also on
    // a CPU where ampx's regions would use the float32 BLAS instead.
    ampx::set_cpu_products(ampx::CpuProducts::kNative);
    const std::filesystem::path dir = argv[1];
    std::filesystem::create_directories(dir);
    for (const char* workload : {"gpt", "gpt-nn", "mnist-cnn", "fashion-mlp"}) {
      export_workload(workload, dir / (std::string(workload) + ".pt"), threads);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ampx_parity_export: " << e.what() << "\n";
    return 1;
  }
}
