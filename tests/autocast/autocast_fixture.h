#pragma once

// What autocast_test.cpp and autocast_restore_test.cpp share.

#include "ampx/autocast.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

namespace ampx {
namespace test {

/// Whether this LibTorch's CPU autocast takes float16 (1.13's does not).
inline bool cpu_half_supported() {
  try {
    AutocastGuard guard(torch::kCPU, torch::kHalf);
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

}  // namespace test
}  // namespace ampx
