#pragma once

// The one place where ampx's diagnostics meet the dispatcher. While at least
// one Observer is alive, a boxed fallback on a mode dispatch key sees every
// op that a thread with a live observer dispatches (and autograd's threads
// serving it), runs the op below itself, and hands its outputs to the
// observers. The key is TESTING_ONLY_GenericMode: the only mode key above
// Autograd that neither LibTorch 1.13 nor 2.x registers anything on (see
// docs/numerics.md); ampx registers its fallback only while observers live,
// so a program that uses the key for its own tests can still do so at other
// times, and a clash is reported when both want it at once.

#include "ampx/debug/nonfinite.h"

#include "../dispatch/observer_key.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <string>
#include <thread>
#include <vector>

namespace ampx {
namespace debug {
namespace detail {

/// The key of the observers' fallback (src/dispatch/observer_key.h, where the
/// kernels that hide their parts from observers find it too).
using ampx::detail::kObserverKey;

/// A floating output tensor to inspect, with the index of the output it
/// came from and whether the op wrote it into an input.
struct OutputTensor {
  size_t output_index;
  at::Tensor tensor;
  bool written;
};

/// One op that just ran.
struct OpEvent {
  const c10::OperatorHandle* op = nullptr;
  const std::string* name = nullptr;  // "aten::addmm"
  Direction direction = Direction::kForward;
  const std::string* scope = nullptr;
  const std::string* backward_node = nullptr;  // "" in forward
  c10::ArrayRef<c10::IValue> inputs;
  c10::ArrayRef<c10::IValue> outputs;
  /// The floating outputs to inspect: not views, and not values a nested op
  /// of the same top-level call already produced (aten::linear returns what
  /// its aten::addmm made: inspected once, attributed to the innermost op).
  std::vector<OutputTensor> tensors;
};

class Observer {
 public:
  Observer(bool forward, bool backward);
  virtual ~Observer() = default;
  Observer(const Observer&) = delete;
  Observer& operator=(const Observer&) = delete;

  /// May throw: the exception leaves the op's dispatcher call.
  virtual void on_op(const OpEvent& event) = 0;

  bool wants(Direction d) const { return d == Direction::kForward ? forward_ : backward_; }
  std::thread::id owner() const { return owner_; }

 private:
  bool forward_;
  bool backward_;
  std::thread::id owner_;
};

/// Starts / stops delivering events to `observer` (on its owner thread).
void attach(Observer* observer);
void detach(Observer* observer);

/// Inputs of an event as summaries (name, dtype, shape, abs max, non-finite
/// count, parameter name).
std::vector<TensorSummary> summarize_inputs(const OpEvent& event);

}  // namespace detail
}  // namespace debug
}  // namespace ampx
