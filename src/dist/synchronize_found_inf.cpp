// GradScaler's found-inf hook that makes every rank agree on overflows.

#include "ampx/dist.h"

#include "ampx/grad_scaler.h"

#include <ATen/ATen.h>

namespace ampx {
namespace dist {

void synchronize_found_inf(GradScaler& scaler, ProcessGroup group) {
  scaler.set_found_inf_hook([group](at::Tensor& found_inf) {
    if (found_inf.is_cuda() && group.has_nccl() && found_inf.is_contiguous()) {
      auto flag = found_inf.view({1});  // NCCL reduces it in place, on the device
      group.all_reduce_max(flag);
      return;
    }
    // Gloo reduces host memory; the flag is one float.
    auto host =
        found_inf.to(at::kCPU, at::kFloat, /*non_blocking=*/false, /*copy=*/true).reshape({1});
    group.all_reduce_max(host);
    found_inf.copy_(host.reshape({}));
  });
}

}  // namespace dist
}  // namespace ampx
