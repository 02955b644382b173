#pragma once

/// \file
/// RangeStatsCollector: while alive, records the magnitude range of every
/// floating output of every op this thread dispatches, per named scope (see
/// scope.h), op and direction (activations in forward, gradients in
/// backward), and what each 16- and 8-bit format would do to those values:
///
/// ```
///   ampx::debug::name_modules(*model);
///   ampx::debug::RangeStatsCollector collector;
///   for (int step = 0; step < 5; ++step) train_step();   // fp32, as usual
///   auto stats = collector.stats();
///   for (const auto& r : stats.records)
///     r.scope;                                   // "blocks.0.fc"
///     r.abs_max;                                 // 7.2e4
///     r.fraction_overflow(Format::kFloat16);     // 0.0013: |x| >= 65520
///   stats.to_json();                             // everything
/// ```
///
/// Counts are exact against each format's rounding boundaries (formats.h) for
/// fp32, fp16 and bf16 tensors; fp64 tensors are counted through their fp32
/// rounding. The collector only reads: the run it watches computes the same
/// numbers as without it. CPU tensors are scanned in one parallel pass; CUDA
/// tensors are copied to the host first (slow, but exact).

#include "ampx/debug/formats.h"
#include "ampx/debug/nonfinite.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ampx {
namespace debug {

/// Counts of what rounding to one format does to a set of values.
struct FormatCounts {
  int64_t overflow = 0;   ///< |x| beyond the format's range: inf (NaN for e4m3fn)
  int64_t to_zero = 0;    ///< non-zero values that round to zero
  int64_t subnormal = 0;  ///< values that round to a subnormal (precision lost)
};

/// Range statistics of the outputs of one op in one scope and direction.
struct RangeRecord {
  /// log2 histogram: bin i counts finite non-zero values with
  /// floor(log2 |x|) == kMinExponent + i (fp32's range, subnormals included).
  static constexpr int kMinExponent = -149;
  static constexpr int kMaxExponent = 127;                       ///< the exponent of the last bin
  static constexpr int kBins = kMaxExponent - kMinExponent + 1;  ///< the number of histogram bins

  std::string scope;                          ///< the innermost scope ("" when none)
  std::string op;                             ///< the op's schema name: "aten::addmm"
  Direction direction = Direction::kForward;  ///< activations (forward) or gradients
  int64_t calls = 0;  ///< outputs recorded
  int64_t numel = 0;  ///< values recorded
  int64_t zeros = 0;  ///< values that are exactly 0
  int64_t non_finite = 0;  ///< inf and NaN values
  double abs_max = 0;      ///< over finite values
  double min_nonzero = 0;  ///< smallest non-zero |x|; 0 when none
  std::array<int64_t, kBins> histogram{};  ///< the log2 histogram (see kMinExponent)
  std::array<FormatCounts, 4> formats{};  ///< indexed like kAllFormats

  /// What rounding to `format` does to these values.
  const FormatCounts& counts(Format format) const;
  /// Values that are neither 0 nor inf nor NaN.
  int64_t nonzero_finite() const { return numel - zeros - non_finite; }
  /// Fractions of the non-zero finite values; 0 when there are none.
  double fraction_overflow(Format format) const;
  /// The fraction that rounds to zero in `format` (as fraction_overflow).
  double fraction_to_zero(Format format) const;
  /// The fraction that rounds to a subnormal in `format` (as fraction_overflow).
  double fraction_subnormal(Format format) const;
  /// Merges another record's values into this one.
  void merge(const RangeRecord& other);
};

/// Everything a RangeStatsCollector recorded: one record per (scope, op,
/// direction).
struct RangeStats {
  std::vector<RangeRecord> records;  ///< in order of first appearance
  int64_t ops_seen = 0;              ///< outputs scanned

  /// Adds `other`'s records (say, another step's) to these: a record of
  /// the same (scope, op, direction) merges into the one here, a new one is
  /// appended; ops_seen adds up.
  void merge(const RangeStats& other);
  /// Every record of `scope`, forward or backward, merged into one.
  RangeRecord merged(const std::string& scope, Direction direction) const;
  /// Scopes in order of first appearance.
  std::vector<std::string> scopes() const;
  /// ops_seen and every record (its histogram as [exponent, count] pairs of
  /// the non-empty bins) as one JSON object.
  std::string to_json() const;
};

/// What a RangeStatsCollector records.
struct RangeStatsOptions {
  /// Record activations (ops outside autograd's backward).
  TORCH_ARG(bool, forward) = true;
  /// Record gradients (ops autograd runs in backward).
  TORCH_ARG(bool, backward) = true;
};

/// Records range statistics of this thread's ops while alive (the top of this
/// header).
class RangeStatsCollector {
 public:
  /// Starts recording, as `options` say.
  explicit RangeStatsCollector(RangeStatsOptions options = {});
  ~RangeStatsCollector();
  RangeStatsCollector(const RangeStatsCollector&) = delete;
  RangeStatsCollector& operator=(const RangeStatsCollector&) = delete;

  /// What has been recorded so far (a copy).
  RangeStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Range statistics of one tensor, as the collector records an output (for
/// tests and for users who scan tensors of their own).
RangeRecord scan_range(const at::Tensor& values);

}  // namespace debug
}  // namespace ampx
