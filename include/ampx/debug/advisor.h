#pragma once

/// \file
/// The precision advisor: from the range statistics of an fp32 run, predicts
/// what fp16, bf16 and the two fp8 formats would do to each layer, the loss
/// scale fp16 needs, and recommends a precision with its reasons:
///
/// ```
///   ampx::debug::RangeStatsCollector collector;
///   for (int i = 0; i < 4; ++i) train_step();          // fp32
///   auto advice = ampx::debug::advise(collector.stats());
///   advice.verdict(Format::kFloat16);    // Verdict::kOverflows
///   advice.recommended;                  // Format::kBFloat16
///   std::cout << advice.to_markdown();   // the table and the reasons:
///   // fp16: 1 layer's activations exceed 65504 (big.fc max 1.2e+05); use bf16
///   // or keep that layer in fp32 with a cast policy (ampx::policy)
/// ```
///
/// Rules (docs/numerics.md explains them): a format "overflows" when any
/// activation of a scope, or any gradient at the loss scale chosen, reaches
/// its overflow boundary; fp16 gets the largest power-of-two loss scale that
/// keeps the largest gradient below 65504 / headroom; gradients "underflow"
/// when more than `underflow_tolerance` of their non-zero values would round
/// to zero. fp8 is judged as Transformer Engine uses it: each tensor scaled so
/// that its amax meets the format's max, activations in e4m3 and gradients in
/// e5m2; what matters then is the fraction that falls below the format's
/// smallest subnormal, read from the log2 histogram (one-binade resolution).
/// Ops outside every named scope (data preparation, the loss and the seed of
/// backward, which autocast keeps in fp32) are judged only when no scope is
/// named at all. Gradients are every value computed in backward, including the
/// intermediates of backward formulas.

#include "ampx/debug/formats.h"
#include "ampx/debug/range_stats.h"

#include <torch/arg.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace ampx {
namespace debug {

/// What a format would do to the values of a run.
enum class Verdict {
  kSafe,          ///< nothing overflows, underflow within tolerance
  kNeedsScaling,  ///< safe with the loss scale (fp16) or per-tensor scaling (fp8) given
  kOverflows,     ///< some activation or gradient overflows
  kUnderflows,    ///< gradients (or fp8 tensors) lose more than the tolerance to zero
};
/// "safe", "needs scaling", "overflows", "underflows".
std::string to_string(Verdict verdict);

/// The thresholds advise() judges by.
struct AdvisorOptions {
  /// Fraction of a tensor class's non-zero values that may round to zero.
  TORCH_ARG(double, underflow_tolerance) = 1e-3;
  /// fp16 loss scale: largest gradient * scale stays below 65504 / headroom.
  TORCH_ARG(double, headroom) = 2.0;
};

/// What one format would do to one scope.
struct ScopeFinding {
  std::string scope;                          ///< the named scope (see scope.h)
  Direction direction = Direction::kForward;  ///< activations or gradients
  double abs_max = 0;                         ///< the scope's largest finite |x|
  double min_nonzero = 0;                     ///< the scope's smallest non-zero |x|
  double fraction_overflow = 0;  ///< at the scale the advisor chose
  double fraction_to_zero = 0;   ///< at the scale the advisor chose
};

/// What one format would do to the run, scope by scope.
struct FormatAdvice {
  Format format = Format::kFloat16;  ///< the format judged
  Verdict verdict = Verdict::kSafe;  ///< the format's verdict on the run
  /// fp16: the loss scale chosen (a power of two); 1 for the others.
  double loss_scale = 1;
  /// Scopes with overflowing values, largest first.
  std::vector<ScopeFinding> overflows;
  /// Scopes that lose more than the tolerance to zero, worst first.
  std::vector<ScopeFinding> underflows;
  /// Sentences, each a reason or a remedy.
  std::vector<std::string> reasons;
};

/// advise()'s answer: every format's advice and the precision to train in.
struct PrecisionAdvice {
  std::array<FormatAdvice, 4> formats;     ///< indexed like kAllFormats
  Format recommended = Format::kBFloat16;  ///< the format to train in
  std::string recommendation;              ///< one sentence

  /// The advice for `format`.
  const FormatAdvice& at(Format format) const;
  /// The verdict for `format`.
  Verdict verdict(Format format) const { return at(format).verdict; }
  /// A table of the formats (verdict, loss scale, overflowing and
  /// underflowing scopes), then the reasons and the recommendation.
  std::string to_markdown() const;
  /// Everything above as one JSON object.
  std::string to_json() const;
};

/// Advice from the statistics of an fp32 run.
PrecisionAdvice advise(const RangeStats& stats, const AdvisorOptions& options = {});

}  // namespace debug
}  // namespace ampx
