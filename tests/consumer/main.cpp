// A user's program against ampx: the installed package (package.consumer)
// or the subproject (package.subproject, configured only). It runs README.md's
// training loop as written (readme_loop.cpp, generated from the README by
// readme_usage.cmake) and a gradient it can check by hand.
#include <ampx/ampx.h>
#include <torch/torch.h>

#include <iostream>
#include <string>

bool readme_loop_trains();

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
  const bool readme = readme_loop_trains();
  std::cout << "README.md's loop " << (readme ? "trains" : "DOES NOT TRAIN") << "\n";
  return ok && readme ? 0 : 1;
}
