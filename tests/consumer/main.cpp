#include <ampx/ampx.h>
#include <torch/torch.h>

#include <iostream>
#include <string>

int main() {
  ampx::GradScaler scaler;
  auto w = torch::ones({2, 2}, torch::requires_grad());
  torch::Tensor loss;
  {
    ampx::AutocastGuard autocast(torch::kCPU);
    loss = torch::mm(w, w).sum().to(torch::kFloat);
  }
  scaler.scale(loss).backward();
  // d/dW sum(W W) = 1 W^T + W^T 1: 4 per element of the 2x2 ones, 16 in all.
  const bool ok = w.grad().sum().item<double>() == 16.0 * scaler.get_scale() &&
                  std::string(AMPX_VERSION) == ampx::version();  // the installed, generated header
  std::cout << "ampx " << ampx::version() << " on LibTorch " << ampx::torch_version()
            << (ok ? ": ok" : ": WRONG") << "\n";
  return ok ? 0 : 1;
}
