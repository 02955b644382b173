// PyTorch's automatic mixed precision recipe, line for line in C++:
// autocast around the forward and the loss, a GradScaler for the backward,
// gradients accumulated over micro-batches and clipped in real units before
// the step. docs/examples.md shows the Python loop beside this one.
//
//   amp_recipe [--device cpu|cuda] [--epochs N]
//
// The data are a linear teacher's outputs with a little noise, so the loss
// has somewhere to go: the program exits 1 unless the last epoch's mean loss
// is below a third of the first's, every loss finite, and the gradients it
// clipped were unscaled (norms below 100, not ~65536 times that). make test
// runs it.

#include <ampx/ampx.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

// make_model(in_size, out_size, num_layers): Linear + ReLU blocks, then a Linear.
torch::nn::Sequential make_model(int64_t in_size, int64_t out_size, int64_t num_layers) {
  torch::nn::Sequential layers;
  for (int64_t i = 0; i < num_layers - 1; ++i) {
    layers->push_back(torch::nn::Linear(in_size, in_size));
    layers->push_back(torch::nn::ReLU());
  }
  layers->push_back(torch::nn::Linear(in_size, out_size));
  return layers;
}

int usage(const std::string& why) {
  std::fprintf(stderr, "amp_recipe: %s\nusage: amp_recipe [--device cpu|cuda] [--epochs N]\n",
               why.c_str());
  return 2;
}

/// The command line: the device (CUDA where there is one) and the number of epochs.
struct Args {
  std::string device_name = torch::cuda::is_available() ? "cuda" : "cpu";
  int64_t epochs = 4;
};

/// Reads --device and --epochs into `args`; returns 0, or usage()'s exit code.
int parse_args(int argc, char** argv, Args& args) {
  for (int i = 1; i < argc; i += 2) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) return usage("missing value for " + arg);
    if (arg == "--device") {
      args.device_name = argv[i + 1];
    } else if (arg == "--epochs") {
      args.epochs = std::atoll(argv[i + 1]);
    } else {
      return usage("unknown argument " + arg);
    }
  }
  if (args.device_name != "cpu" && args.device_name != "cuda") {
    return usage("--device must be cpu or cuda");
  }
  if (args.epochs < 2) return usage("--epochs must be at least 2");
  if (args.device_name == "cuda" && !torch::cuda::is_available()) {
    return usage("--device cuda, but this LibTorch or machine has no CUDA");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (const int code = parse_args(argc, argv, args)) return code;
  const std::string& device_name = args.device_name;
  const int64_t epochs = args.epochs;
  const torch::Device device(device_name == "cuda" ? torch::kCUDA : torch::kCPU);
  // float16 where the recipe uses it (CUDA); bfloat16 on the CPU.
  const auto dtype = device.is_cuda() ? torch::kHalf : torch::kBFloat16;
  const bool use_amp = true;

  const int64_t batch_size = 64, in_size = 64, out_size = 16, num_layers = 3, num_batches = 32;
  const int64_t iters_to_accumulate = 2;
  const double max_norm = 1.0;

  torch::manual_seed(0);
  const auto teacher = torch::randn({in_size, out_size}) / std::sqrt(double(in_size));
  std::vector<torch::Tensor> data, targets;
  for (int64_t b = 0; b < num_batches; ++b) {
    const auto x = torch::randn({batch_size, in_size});
    data.push_back(x.to(device));
    targets.push_back((x.mm(teacher) + 0.01 * torch::randn({batch_size, out_size})).to(device));
  }

  auto net = make_model(in_size, out_size, num_layers);
  net->to(device);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  ampx::GradScaler scaler(ampx::GradScalerOptions().enabled(use_amp));

  std::vector<double> epoch_loss;
  double largest_norm = 0;  // of the unscaled gradients, before clipping
  for (int64_t epoch = 0; epoch < epochs; ++epoch) {
    double total = 0;
    for (int64_t i = 0; i < num_batches; ++i) {
      torch::Tensor loss;
      {
        ampx::AutocastGuard autocast(device.type(), dtype, use_amp);
        const auto output = net->forward(data[i]);
        loss = torch::mse_loss(output, targets[i]);
        loss = loss / iters_to_accumulate;
      }
      scaler.scale(loss).backward();
      if ((i + 1) % iters_to_accumulate == 0) {
        scaler.unscale_(opt);
        const double norm = torch::nn::utils::clip_grad_norm_(net->parameters(), max_norm);
        largest_norm = std::max(largest_norm, norm);
        scaler.step(opt);
        scaler.update();
        opt.zero_grad();
      }
      total += loss.item<double>() * iters_to_accumulate;
    }
    epoch_loss.push_back(total / num_batches);
    std::printf("epoch %lld: mean loss %.5f, loss scale %.0f\n", static_cast<long long>(epoch),
                epoch_loss.back(), scaler.get_scale());
  }

  const bool finite =
      std::all_of(epoch_loss.begin(), epoch_loss.end(), [](double l) { return std::isfinite(l); });
  const bool learned = epoch_loss.back() < epoch_loss.front() / 3;
  // Clipped in real units: gradients still multiplied by the scale (65536)
  // would have norms in the thousands.
  const bool unscaled = largest_norm < 100;
  const bool ok = finite && learned && unscaled;
  std::printf("%s on %s in %s: last epoch's loss %.3fx the first's; largest gradient norm %.3g\n",
              ok ? "ok" : "FAILED", device_name.c_str(),
              dtype == torch::kHalf ? "float16" : "bfloat16",
              epoch_loss.back() / epoch_loss.front(), largest_norm);
  return ok ? 0 : 1;
}
