// Writes a GradScaler state with ampx for tests/reference/torch_reference.py
// check-state to read with Python's torch.load (and load into its GradScaler).

#include "ampx/grad_scaler.h"
#include "ampx/serialize.h"

#include <torch/torch.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: interop_save FILE\n";
    return 2;
  }
  ampx::GradScaler scaler(ampx::GradScalerOptions()
                              .init_scale(1024.0)
                              .growth_factor(4.0)
                              .backoff_factor(0.125)
                              .growth_interval(11));
  auto p = torch::zeros({2}, torch::requires_grad());
  torch::optim::SGD opt({p}, 0.0);
  // One overflow (1024 * 0.125 = 128), then 5 clean steps (tracker 5).
  for (int step = 0; step < 6; ++step) {
    scaler.scale(torch::ones({}));
    p.mutable_grad() = torch::full({2}, step == 0 ? INFINITY : 1.0f);
    scaler.step(opt);
    scaler.update();
  }
  if (scaler.get_scale() != 128.0 || scaler.get_growth_tracker() != 5) {
    std::cerr << "unexpected scaler state: " << scaler.get_scale() << "\n";
    return 1;
  }
  scaler.update(512.0);  // PyTorch's update(new_scale): the tracker stays
  ampx::save_state_dict(scaler.state_dict(), argv[1]);
  std::cout << "wrote " << argv[1] << "\n";
  return 0;
}
