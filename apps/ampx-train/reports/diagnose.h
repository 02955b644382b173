#pragma once

// ampx-train --diagnose: a few fp32 steps of the workload under
// ampx::debug::RangeStatsCollector, then ampx::debug::advise(): which
// precision fits each layer, on the console and in <out-dir>/diagnose.md,
// diagnose.json (the advice and the statistics) and diagnose.png (gnuplot:
// each layer's magnitude range against the ranges of fp16, bf16 and fp8).
//
//   Diagnosis d = diagnose(config, *workload);   // config.diagnose_steps steps
//   std::cout << d.advice_markdown;               // the advisor's table and reasons
//
// docs/numerics.md shows a report and how to read it.

#include "cli/config.h"
#include "run/workloads.h"

#include <ampx/debug/range_stats.h>

#include <string>

namespace ampx::train {

struct Diagnosis {
  std::string advice_markdown;  // PrecisionAdvice::to_markdown()
  std::string markdown_path;    // <out-dir>/diagnose.md
  std::string json_path;        // <out-dir>/diagnose.json: {"advice": ..., "stats": ...}
  std::string plot_path;        // <out-dir>/diagnose.png; empty when gnuplot failed or is missing
  std::string plot_note;        // why there is no plot
};

/// Trains config.diagnose_steps fp32 steps from config.seed under range
/// statistics (forward and backward; not the optimizer's step) and writes
/// the report.
Diagnosis diagnose(const TrainConfig& config, Workload& workload);

/// Markdown: one row per scope, the magnitude range [min non-zero, max] of
/// its activations and of its gradients, as values and as powers of two.
std::string range_table(const ampx::debug::RangeStats& stats);

}  // namespace ampx::train
