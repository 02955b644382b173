#pragma once

/// \file
/// NonFiniteGuard: while alive, checks every floating output of every op this
/// thread dispatches, forward and backward, and reports the first inf or NaN:
/// the op, the direction, the scope it ran in (see scope.h), the step, its
/// inputs and the bad element. Where `torch.autograd.detect_anomaly` looks at
/// backward only, this finds the op that made a forward activation overflow:
///
/// ```
///   ampx::debug::name_modules(*model);
///   try {
///     ampx::debug::NonFiniteGuard guard;
///     ampx::AutocastGuard autocast(torch::kCPU, torch::kHalf);
///     scaler.scale(loss_fn(model->forward(x), y)).backward();
///   } catch (const ampx::debug::NonFiniteError& e) {
///     e.report().op;         // "aten::addmm"
///     e.report().direction;  // Direction::kForward
///     e.report().scope;      // "blocks.2.mlp.fc2"
///     std::cerr << e.what(); // everything, one paragraph
///   }
/// ```
///
/// Works under autocast, O1/O2/O3 models and DistributedDataParallel, on CPU
/// and CUDA (where each check costs a host synchronisation). Views are not
/// checked (their base was); in-place ops are, and their report says that the
/// mutated input shows its value after the op. Ops in the c10d namespace
/// (collectives) are not checked: their results arrive asynchronously.
/// Values written on purpose are not faults: an op given an inf or NaN scalar
/// (`masked_fill(mask, -inf)` for causal attention, `full({n, n}, -inf)`)
/// makes deliberate values, and so does an op whose only non-finite inputs
/// hold deliberate ones (`scores + mask`); they are neither reported nor
/// counted.
///
/// Off costs nothing: the dispatcher entry ampx uses (see docs/numerics.md)
/// is registered only while a guard or a RangeStatsCollector is alive.
/// A guard belongs to the thread that made it and must be destroyed there;
/// autograd's device threads serving that thread's backward are checked too.

#include "ampx/direction.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ampx {
namespace debug {

// The library's one forward/backward enum (ampx/direction.h), by the name
// ampx::debug has always used.
using ampx::Direction;
using ampx::to_string;  // to_string(Direction): "forward", "backward"

/// What a NonFiniteGuard does when an op outputs inf or NaN.
enum class NonFiniteAction {
  kThrow,  ///< throw NonFiniteError from the op that produced the value
  kWarn,   ///< TORCH_WARN the report, keep it in reports(), go on
};

/// NonFiniteGuard's settings, set by chained calls:
/// `NonFiniteOptions().action(NonFiniteAction::kWarn).step(step)`.
struct NonFiniteOptions {
  /// What happens on a non-finite output.
  TORCH_ARG(NonFiniteAction, action) = NonFiniteAction::kThrow;
  /// Check ops of the forward pass (everything outside autograd's backward).
  TORCH_ARG(bool, forward) = true;
  /// Check ops that autograd runs in backward.
  TORCH_ARG(bool, backward) = true;
  /// With kWarn: reports kept (and warned) at most; later ones are counted.
  TORCH_ARG(int64_t, max_reports) = 16;
  /// The training step reports quote (-1: unknown). A guard that lives
  /// across steps is told each with NonFiniteGuard::set_step().
  TORCH_ARG(int64_t, step) = -1;
};

/// One tensor an op took.
struct TensorSummary {
  std::string name;  ///< the schema's argument name: "self", "mat2"
  c10::ScalarType dtype = c10::ScalarType::Undefined;  ///< its dtype
  std::vector<int64_t> shape;                          ///< its shape
  double abs_max = 0;      ///< over the finite values
  int64_t non_finite = 0;  ///< inf and NaN elements it already held
  std::string parameter;   ///< "blocks.0.fc.weight" for a named parameter
  bool written = false;    ///< the op wrote into it (in place, out=): values after the op
};

/// The first inf or NaN an op output: which op, where, and what it took.
struct NonFiniteReport {
  std::string op;                             ///< "aten::log"
  Direction direction = Direction::kForward;  ///< forward, or in autograd's backward
  std::string scope;          ///< innermost scope ("" when none)
  std::string backward_node;  ///< autograd node in backward: "LogBackward0"
  int64_t step = -1;          ///< the guard's step (NonFiniteOptions::step), -1 when unknown
  size_t output_index = 0;    ///< which output of the op
  c10::ScalarType dtype = c10::ScalarType::Undefined;  ///< the output's dtype
  std::vector<int64_t> shape;                          ///< the output's shape
  int64_t numel = 0;                                   ///< the output's elements
  int64_t nan_count = 0;                               ///< its NaN elements
  int64_t inf_count = 0;                               ///< its inf and -inf elements
  std::vector<int64_t> first_index;  ///< index of the first bad element
  double first_value = 0;            ///< inf, -inf or nan
  bool in_place = false;             ///< output is a mutated input
  std::vector<TensorSummary> inputs;  ///< the op's tensor arguments, in schema order

  /// True when some input the op only read already held inf/NaN (the op
  /// propagated them); false when this op created them.
  bool propagated() const;
  /// A paragraph naming all of the above.
  std::string message() const;
};

/// What NonFiniteGuard throws (NonFiniteAction::kThrow); what() is the
/// report's message().
class NonFiniteError : public c10::Error {
 public:
  /// An error whose message is `report.message()`.
  explicit NonFiniteError(NonFiniteReport report);
  /// The report of the op that made the inf or NaN.
  const NonFiniteReport& report() const { return report_; }

 private:
  NonFiniteReport report_;
};

/// Checks every floating output of this thread's ops while alive (the top
/// of this header).
class NonFiniteGuard {
 public:
  /// Starts checking, as `options` say.
  explicit NonFiniteGuard(NonFiniteOptions options = {});
  ~NonFiniteGuard();
  NonFiniteGuard(const NonFiniteGuard&) = delete;
  NonFiniteGuard& operator=(const NonFiniteGuard&) = delete;

  /// With kWarn: the first max_reports reports.
  const std::vector<NonFiniteReport>& reports() const;
  /// With kWarn: every non-finite output seen, also those past max_reports.
  int64_t count() const;
  /// The step later reports quote (NonFiniteOptions::step of a guard that
  /// lives across steps). Call between steps, not while ops run.
  void set_step(int64_t step);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace debug
}  // namespace ampx
