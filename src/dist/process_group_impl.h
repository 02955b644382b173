#pragma once

// ProcessGroup's insides, shared by the process group and DDP sources.

#include "ampx/dist.h"

#include <ATen/Tensor.h>

#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ampx/detail/compat.h"
#include "network.h"

#if defined(AMPX_WITH_DIST)
#if __has_include(<torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#else  // newer PyTorch names them .h
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.h>
#endif
#if defined(AMPX_WITH_NCCL)
#if __has_include(<torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#else  // newer PyTorch names them .h
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.h>
#endif
#endif
#endif

namespace ampx {
namespace dist {

/// An exception's message, without LibTorch's C++ backtrace.
inline std::string message_of(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

/// The factors a gradient mean's sum is divided by, before and after it:
/// fp16 divides by a power of two near sqrt(world) before the sum and by the
/// rest after, so that neither the sum of large gradients overflows nor small
/// ones underflow (FSDP's rule; on 2 ranks all of it before, where a sum of
/// finite halves cannot overflow); other dtypes divide once, after.
std::pair<double, double> divide_factors(int64_t world, c10::ScalarType dtype);

#if defined(AMPX_WITH_DIST)
// What Gloo and NCCL groups derive from: c10d::Backend since LibTorch 2.0,
// c10d::ProcessGroup before; both have the collectives used here.
#if AMPX_TORCH_AT_LEAST(2, 0)
using C10dBackend = c10d::Backend;
#else
using C10dBackend = c10d::ProcessGroup;
#endif
#endif

struct ProcessGroup::Impl {
  int64_t rank = 0;
  int64_t world_size = 1;
  std::chrono::milliseconds timeout{0};
  /// What a collective may take: the timeout less the probe that names the
  /// lost peers when one fails, so that the failure comes within the timeout.
  std::chrono::milliseconds collective_timeout{0};
  std::chrono::milliseconds probe_budget{0};
  std::string endpoint;          // gloo_endpoint()
  std::vector<net::Peer> peers;  // by rank, this one's included
  /// Collectives this rank has started, in the order every rank starts
  /// them: its listener tells probing peers, and a peer that counts fewer
  /// has not reached the collective the others wait in.
  std::shared_ptr<std::atomic<int64_t>> collectives = std::make_shared<std::atomic<int64_t>>(0);
  std::unique_ptr<net::LivenessListener> listener;
  /// Throws the failure of collective `what`: `e`'s message, after a probe
  /// of every peer, naming those that do not answer (host down, link cut),
  /// refuse (process gone), accept but do not reply (process stopped) or
  /// reply but have not started as many collectives as this rank.
  [[noreturn]] void fail(const std::string& what, const std::exception& e) const;
#if defined(AMPX_WITH_DIST)
  c10::intrusive_ptr<C10dBackend> gloo;
  c10::intrusive_ptr<C10dBackend> nccl;  // null: none (CPU build, or InitOptions::nccl(false))
  bool gloo_reduce_scatter = true;       // until this Gloo says it has none
  /// The backend that carries collectives on `t`: NCCL for CUDA tensors
  /// when there is one, Gloo otherwise.
  C10dBackend& backend_for(const at::Tensor& t) const {
    return nccl && t.is_cuda() ? *nccl : *gloo;
  }
  c10::intrusive_ptr<c10d::Work> all_reduce_async(at::Tensor& t, c10d::ReduceOp op);
  /// Starts the all-gather of ProcessGroup::all_gather (16-bit types as bytes).
  c10::intrusive_ptr<c10d::Work> all_gather_async(at::Tensor& output, const at::Tensor& input);
  /// A reduce-scatter (sum) in flight: where Gloo has none (LibTorch 1.13),
  /// an all-reduce of `input`, whose chunk wait() then copies to `output`.
  struct ReduceScatter {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor output, input;
    bool via_all_reduce = false;
  };
  /// Starts the reduce-scatter of ProcessGroup::reduce_scatter_sum.
  ReduceScatter reduce_scatter_async(at::Tensor& output, at::Tensor& input);
  /// Waits for `work` (collective `what`); a failure names the lost peers (fail()).
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) const;
  /// Waits for a reduce-scatter and leaves this rank's chunk in its output.
  void wait(ReduceScatter& rs) const;
  /// Makes the current stream wait for `work`, a collective of NCCL's, and
  /// not the host (NCCL's watchdog times it out); a failure known now is
  /// thrown as wait() throws it.
  void stream_wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) const;
#endif
  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl();
};

}  // namespace dist

namespace detail {

/// The route from ampx's dist sources to a ProcessGroup's insides (its
/// constructor and Impl are private: users see only the collectives).
struct ProcessGroupAccess {
  using Impl = dist::ProcessGroup::Impl;
  static dist::ProcessGroup make(std::shared_ptr<Impl> impl) {
    return dist::ProcessGroup(std::move(impl));
  }
  static Impl& impl(const dist::ProcessGroup& group) { return *group.impl_; }
};

}  // namespace detail

namespace dist {

/// How a tensor travels when Gloo only copies its bytes (broadcast, all-
/// gather): 16-bit floats and bool as their bytes (uint8, a view of the same
/// storage, flattened). Gloo builds differ in the 16-bit types they accept at
/// all: 1.13's has float16 only, Debian's 2.14 neither float16 nor bfloat16
/// ("Gloo: Invalid scalar type"); every build moves uint8. A non-contiguous
/// tensor, which has no flat byte view, goes as float16 (bfloat16) or uint8.
inline at::Tensor as_wire(const at::Tensor& t) {
  const auto type = t.scalar_type();
  if (type != at::kBFloat16 && type != at::kHalf && type != at::kBool) return t;
  if (t.is_contiguous()) return t.reshape({-1}).view(at::kByte);
  return type == at::kBool ? t.view(at::kByte) : t.view(at::kHalf);
}

}  // namespace dist
}  // namespace ampx
