#include "diagnose.h"

#include "cli/shell.h"
#include "machine.h"
#include "output_file.h"
#include "report.h"
#include "run/step_diagnostics.h"
#include "run/trainer.h"

#include <ampx/debug/advisor.h>
#include <ampx/debug/formats.h>
#include <ampx/debug/scope.h>
#include <ampx/version.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <vector>

namespace ampx::train {
namespace {

namespace fs = std::filesystem;
namespace debug = ampx::debug;

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, v);
  return buf;
}

/// [log2 min non-zero, log2 max] of a record; false when it holds no
/// non-zero finite value.
bool log2_range(const debug::RangeRecord& r, double& lo, double& hi) {
  if (r.nonzero_finite() <= 0 || r.min_nonzero <= 0 || r.abs_max <= 0) return false;
  lo = std::log2(r.min_nonzero);
  hi = std::log2(r.abs_max);
  return true;
}

std::string range_cell(const debug::RangeRecord& r) {
  double lo = 0, hi = 0;
  if (!log2_range(r, lo, hi)) return r.numel > 0 ? "all zero" : "-";
  return fmt("%.3g", r.min_nonzero) + " .. " + fmt("%.3g", r.abs_max) + " (2^" + fmt("%.1f", lo) +
         " .. 2^" + fmt("%.1f", hi) + ")";
}

/// diagnose.gp and its data: one row per scope (first at the top), a bar for
/// the activations' log2 range and one for the gradients', and each
/// format's [min subnormal, max] as a pair of vertical lines.
void write_plot(const fs::path& out, const std::string& title, const debug::RangeStats& stats) {
  const auto scopes = stats.scopes();
  const int n = static_cast<int>(scopes.size());
  double x_lo = -26, x_hi = 17;  // fp16's and fp8's ranges at least
  {
    std::ostringstream f;
    f << "# row scope act_log2_lo act_log2_hi grad_log2_lo grad_log2_hi ('?': none)\n";
    for (int i = 0; i < n; ++i) {
      f << n - 1 - i << " \"" << ampx::debug::scope_label(scopes[i]) << "\"";
      for (auto dir : {debug::Direction::kForward, debug::Direction::kBackward}) {
        double lo = 0, hi = 0;
        if (log2_range(stats.merged(scopes[i], dir), lo, hi)) {
          f << " " << lo << " " << hi;
          x_lo = std::min(x_lo, lo);
          x_hi = std::max(x_hi, hi);
        } else {
          f << " ? ?";
        }
      }
      f << "\n";
    }
    write_output_file(out / "diagnose-ranges.dat", f.str());
  }
  x_lo = std::floor(x_lo) - 2;
  x_hi = std::ceil(x_hi) + 2;
  const char* colors[] = {"#d62728", "#1f77b4", "#2ca02c", "#ff7f0e"};
  std::ostringstream formats;
  {
    std::ostringstream f;
    f << "# per format (gnuplot index): x y dx dy of its lines at log2 min subnormal and "
         "log2 max\n";
    for (size_t k = 0; k < debug::kAllFormats.size(); ++k) {
      const auto& limits = debug::format(debug::kAllFormats[k]);
      const double lo = std::log2(limits.min_subnormal), hi = std::log2(limits.max);
      f << "# " << limits.name << "\n"
        << lo << " -0.6 0 " << n + 0.2 << "\n"
        << hi << " -0.6 0 " << n + 0.2 << "\n\n\n";
      formats << ", \\\n     'diagnose-formats.dat' index " << k
              << " using 1:2:3:4 with vectors nohead lw 2 dt 2 lc rgb '" << colors[k] << "' title '"
              << limits.name << ": 2^" << fmt("%.0f", lo) << " .. " << fmt("%.4g", limits.max)
              << (lo < x_lo && hi > x_hi ? " (beyond the plot)" : "") << "'";
    }
    write_output_file(out / "diagnose-formats.dat", f.str());
  }
  std::ostringstream f;
  f << "# gnuplot diagnose.gp  (run in this folder)\n"
    << "set terminal pngcairo noenhanced size 1100," << 160 + 20 * n << " font ',10'\n"
    << "set output 'diagnose.png'\n"
    << "set title '" << title << "'\n"
    << "set datafile missing '?'\n"
    << "set xlabel 'log2 |x|: the bar spans [smallest non-zero, largest] of each scope'\n"
    << "set xrange [" << x_lo << ":" << x_hi << "]\n"
    << "set yrange [-0.7:" << n - 0.3 << "]\n"
    << "set grid xtics\nset xtics 4\nset ytics nomirror\n"
    << "set key outside bottom center horizontal\n"
    << "set style fill solid 0.7 noborder\n"
    << "plot 'diagnose-ranges.dat' using (($3+$4)/2):($1+0.17):(($4-$3)/2):(0.14):ytic(2) "
       "with boxxyerror lc rgb '#4878b0' title 'activations', \\\n"
    << "     '' using (($5+$6)/2):($1-0.17):(($6-$5)/2):(0.14) with boxxyerror lc rgb '#9467bd' "
       "title 'gradients'"
    << formats.str() << "\n";
  write_output_file(out / "diagnose.gp", f.str());
}

}  // namespace

std::string range_table(const debug::RangeStats& stats) {
  std::ostringstream t;
  t << "| scope | activations: min non-zero .. max | gradients: min non-zero .. max |\n"
    << "| --- | --- | --- |\n";
  for (const auto& scope : stats.scopes()) {
    t << "| " << ampx::debug::scope_label(scope) << " | "
      << range_cell(stats.merged(scope, debug::Direction::kForward)) << " | "
      << range_cell(stats.merged(scope, debug::Direction::kBackward)) << " |\n";
  }
  return t.str();
}

Diagnosis diagnose(const TrainConfig& config, Workload& workload) {
  const Mode mode = parse_mode("fp32", config);
  const torch::Device device = config.torch_device();
  ModeSetUp setup = set_up_mode(config, workload, mode, device);  // names the modules
  StepDiagnostics diagnostics(StepDiagnostics::Options{std::nullopt, /*range_stats=*/true});
  std::vector<double> losses;
  for (int64_t step = 0; step < config.diagnose_steps; ++step) {
    const StepOutcome out =
        train_step(setup, workload, workload.batch(step, device), nullptr, &diagnostics);
    losses.push_back(out.loss.item<double>());
    if (config.progress != "none") {
      std::printf("[diagnose] step %lld/%lld: loss %.4f\n", static_cast<long long>(step + 1),
                  static_cast<long long>(config.diagnose_steps), losses.back());
      std::fflush(stdout);
    }
  }
  const debug::RangeStats& stats = diagnostics.range_stats();
  const debug::PrecisionAdvice advice = debug::advise(stats);

  Diagnosis d;
  d.advice_markdown = advice.to_markdown();
  const fs::path out = config.out_dir;
  fs::create_directories(out);
  std::ostringstream context;
  context << config.diagnose_steps << " fp32 steps of " << workload.name() << " (batch "
          << config.batch_size << ", seed " << config.seed << ", " << config.device << ", "
          << cpu_model() << ", LibTorch " << ampx::torch_version() << "), " << stats.ops_seen
          << " op outputs scanned";

  std::ostringstream md;
  md << "# ampx-train --diagnose: " << workload.name() << "\n\n"
     << context.str() << ". How to read this: docs/numerics.md.\n\n"
     << "## Advice\n\n"
     << d.advice_markdown << "\n\n"
     << "## Magnitudes per scope\n\n"
     << range_table(stats);
  d.markdown_path = (out / "diagnose.md").string();
  write_output_file(d.markdown_path, md.str());

  const nlohmann::json json = {
      {"workload", workload.name()},
      {"steps", config.diagnose_steps},
      {"settings",
       {{"batch_size", config.batch_size},
        {"seed", config.seed},
        {"lr", config.lr},
        {"device", config.device},
        {"threads", config.threads}}},
      {"machine",
       {{"cpu", cpu_model()}, {"blas", blas_library()}, {"libtorch", ampx::torch_version()}}},
      {"losses", losses},
      {"advice", nlohmann::json::parse(advice.to_json())},
      {"stats", nlohmann::json::parse(stats.to_json())},
  };
  d.json_path = (out / "diagnose.json").string();
  write_output_file(d.json_path, json.dump(1) + "\n");

  write_plot(out,
             "ampx-train --diagnose " + workload.name() + ": " +
                 std::to_string(config.diagnose_steps) + " fp32 steps, batch " +
                 std::to_string(config.batch_size),
             stats);
  d.plot_path = run_gnuplot(out.string(), "diagnose.gp", "diagnose.png", d.plot_note);
  return d;
}

}  // namespace ampx::train
