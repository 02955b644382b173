#pragma once

// ProcessGroup's insides, shared by the process group and DDP sources.

#include "ampx/dist.h"

#include <ATen/Tensor.h>

#include <c10/util/Exception.h>

#include <chrono>
#include <exception>
#include <string>

#if defined(AMPX_WITH_DIST)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

namespace ampx {
namespace dist {

/// An exception's message, without LibTorch's C++ backtrace.
inline std::string message_of(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

struct ProcessGroup::Impl {
  int64_t rank = 0;
  int64_t world_size = 1;
  std::chrono::milliseconds timeout{0};
#if defined(AMPX_WITH_DIST)
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
  bool gloo_reduce_scatter = true;  // until this Gloo says it has none
  c10::intrusive_ptr<c10d::Work> all_reduce_async(at::Tensor& t, c10d::ReduceOp op);
#endif
};

/// How a tensor travels when Gloo only copies its bytes (broadcast, all-
/// gather): bfloat16 as float16 (every Gloo build has it; 1.13's has no
/// bfloat16 or int16), bool as uint8.
inline at::Tensor as_wire(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16:
      return t.view(at::kHalf);
    case at::kBool:
      return t.view(at::kByte);
    default:
      return t;
  }
}

}  // namespace dist
}  // namespace ampx
