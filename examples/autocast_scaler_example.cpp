// Trains a small MLP on a real regression problem (y = sin(3x1) + x2*x3 + noise)
// with autocast and dynamic loss scaling, printing loss and scale per step.
//
//   autocast_scaler_example [--device cpu|cuda] [--dtype bf16|fp16] [--steps N]
//
// Defaults: CPU in bfloat16 (float16 where this LibTorch can run it on the
// CPU), CUDA in float16. With float16 the scaler earns its keep: the scale
// grows every 25 clean steps until a step overflows, which is skipped and
// halves the scale.

#include <ampx/ampx.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(3, 256));
    fc2 = register_module("fc2", torch::nn::Linear(256, 256));
    fc3 = register_module("fc3", torch::nn::Linear(256, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    return fc3(torch::gelu(fc2(torch::gelu(fc1(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

int usage(const char* why) {
  std::fprintf(stderr, "error: %s\nusage: autocast_scaler_example [--device cpu|cuda] "
                       "[--dtype bf16|fp16] [--steps N]\n", why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string device_name = "cpu", dtype_name;
  int steps = 300;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) return usage(("missing value for " + arg).c_str());
    if (arg == "--device") device_name = argv[++i];
    else if (arg == "--dtype") dtype_name = argv[++i];
    else if (arg == "--steps") steps = std::atoi(argv[++i]);
    else return usage(("unknown argument " + arg).c_str());
  }
  if (device_name != "cpu" && device_name != "cuda") return usage("--device must be cpu or cuda");
  if (steps <= 0) return usage("--steps must be a positive integer");
  const auto device = device_name == "cuda" ? torch::kCUDA : torch::kCPU;
  if (device == torch::kCUDA && !torch::cuda::is_available()) {
    return usage("--device cuda, but CUDA is not available in this LibTorch/machine");
  }
  torch::ScalarType dtype;
  if (dtype_name.empty()) {
    dtype = device == torch::kCUDA ? torch::kHalf : torch::kBFloat16;
  } else if (dtype_name == "bf16" || dtype_name == "fp16") {
    dtype = dtype_name == "fp16" ? torch::kHalf : torch::kBFloat16;
  } else {
    return usage("--dtype must be bf16 or fp16");
  }
  at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));

  torch::manual_seed(0);
  // The data: 4096 points, 3 features, 3584 to train and 512 held out.
  auto x = torch::rand({4096, 3}) * 4 - 2;
  auto y = (torch::sin(3 * x.select(1, 0)) + x.select(1, 1) * x.select(1, 2)).unsqueeze(1) +
           0.05 * torch::randn({4096, 1});
  x = x.to(device);
  y = y.to(device);
  auto x_train = x.slice(0, 0, 3584), y_train = y.slice(0, 0, 3584);
  auto x_test = x.slice(0, 3584), y_test = y.slice(0, 3584);

  Mlp model;
  model->to(device);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3));
  ampx::GradScaler scaler(ampx::GradScalerOptions().init_scale(1024.0).growth_interval(25));

  std::cout << "ampx " << ampx::version() << " on LibTorch " << ampx::torch_version() << ", "
            << device_name << ", autocast " << (dtype == torch::kHalf ? "float16" : "bfloat16")
            << ", " << at::get_num_threads() << " threads\n";
  std::printf("%6s %12s %12s %8s\n", "step", "train_loss", "loss_scale", "stepped");
  int skipped = 0;
  const int64_t batch = 256;
  for (int step = 0; step < steps; ++step) {
    const int64_t start = (step * batch) % x_train.size(0);
    auto xb = x_train.slice(0, start, start + batch), yb = y_train.slice(0, start, start + batch);
    opt.zero_grad();
    torch::Tensor loss;
    {
      ampx::AutocastGuard autocast(device, dtype);
      loss = torch::mse_loss(model->forward(xb), yb);  // fp32: mse_loss is on the fp32 list
    }
    scaler.scale(loss).backward();
    scaler.unscale_(opt);
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    const bool stepped = scaler.step(opt).stepped();
    skipped += stepped ? 0 : 1;
    const double scale = scaler.get_scale();  // the scale this step used
    scaler.update();
    if (step % 10 == 0 || !stepped || step == steps - 1) {
      std::printf("%6d %12.5f %12.0f %8s\n", step, loss.item<double>(), scale,
                  stepped ? "yes" : "SKIPPED");
    }
  }
  torch::Tensor test_loss;
  {
    torch::NoGradGuard no_grad;
    ampx::AutocastGuard autocast(device, dtype);
    test_loss = torch::mse_loss(model->forward(x_test), y_test);
  }
  const double baseline = y_test.var().item<double>();
  std::printf("held-out MSE %.5f (predicting the mean: %.5f); %d of %d steps skipped; "
              "final scale %.0f\n",
              test_loss.item<double>(), baseline, skipped, steps, scaler.get_scale());
  return 0;
}
