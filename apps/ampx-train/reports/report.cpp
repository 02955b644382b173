#include "report.h"

#include "cli/shell.h"
#include "memory_origins.h"
#include "output_file.h"

#include "machine.h"
#include "models.h"

#include <ampx/kernels.h>
#include <ampx/version.h>

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace ampx::train {
namespace {

namespace fs = std::filesystem;

std::string cell(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, v);
  return buf;
}

/// The fp32 run if there is one, else the first: what ratios are against.
const RunResult& baseline_of(const std::vector<RunResult>& results) {
  for (const auto& r : results) {
    if (r.mode == "fp32") return r;
  }
  return results.front();
}

}  // namespace

std::string comparison_table(const Workload& workload, const std::vector<RunResult>& results) {
  TORCH_CHECK(!results.empty(), "comparison_table: no results");
  const auto& base = baseline_of(results);
  const bool percent = workload.metric_is_percent();
  std::ostringstream t;
  t << "| mode | dtype | " << workload.unit() << "/s | speed-up | step ms | peak MiB | memory | "
    << "optim B/param | train loss | test loss | test " << workload.metric_name()
    << " | skipped | loss scale |\n";
  t << "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
       "|\n";
  for (const auto& r : results) {
    const double mem = base.peak_bytes > 0 ? double(r.peak_bytes) / base.peak_bytes - 1 : 0;
    t << "| " << r.mode << " | " << r.dtype << " | " << cell("%.0f", r.items_per_s) << " | "
      << cell("%.2fx", r.items_per_s / base.items_per_s) << " | " << cell("%.1f", r.median_step_ms)
      << " | " << cell("%.1f", r.peak_bytes / 1048576.0) << " | "
      << (&r == &base ? std::string("-") : cell("%+.1f%%", 100 * mem)) << " | "
      << (r.params > 0 ? cell("%.2f", optimizer_bytes_per_param(r)) : std::string("-")) << " | "
      << cell("%.4f", r.train_loss) << " | " << cell("%.4f", r.eval.loss) << " | "
      << (percent ? cell("%.2f%%", r.eval.metric) : cell("%.3f", r.eval.metric)) << " | "
      << r.skipped << " | " << cell("%g", r.final_scale) << " |\n";
  }
  return t.str();
}

nlohmann::json comparison_json(const TrainConfig& c, const Workload& workload,
                               const std::vector<RunResult>& results) {
  const auto& base = baseline_of(results);
  nlohmann::json modes = nlohmann::json::array();
  for (const auto& r : results) {
    modes.push_back({
        {"mode", r.mode},
        {"dtype", r.dtype},
        {"blas", r.blas},
        {"cpu_products", r.cpu_products},
        {"steps", r.steps},
        {"timed_steps", r.timed_steps},
        {workload.unit() + "_per_s", r.items_per_s},
        {"speedup", r.items_per_s / base.items_per_s},
        {"median_step_ms", r.median_step_ms},
        {"peak_allocated_bytes", r.peak_bytes},
        {"peak_vs_baseline", base.peak_bytes > 0 ? double(r.peak_bytes) / base.peak_bytes : 0.0},
        {"rank_peak_allocated_bytes", r.rank_peak_bytes},
        {"optimizer_bytes", r.optimizer_bytes},
        {"optimizer_bytes_per_param", optimizer_bytes_per_param(r)},
        {"weight_and_grad_bytes", r.weight_bytes},
        {"gathered_bytes", r.gathered_bytes},
        {"params", r.params},
        {"train_loss", r.train_loss},
        {"test_loss", r.eval.loss},
        {"test_" + workload.metric_name(), r.eval.metric},
        {"skipped_steps", r.skipped},
        {"final_loss_scale", r.final_scale},
        {"metrics", r.metrics_path},
    });
    if (is_fp8_mode(r.mode)) modes.back()["tail_start"] = r.tail_start;
    if (!r.memory_origins.empty()) {  // --memory-origins
      modes.back()["memory_origins"] = memory_origins_json(r.memory_origins);
    }
    if (r.mode == "auto") {  // the plan watch's findings, the plan it left
      modes.back()["plan_watch"] = r.plan_watch;
      if (!r.watched_plan_path.empty()) modes.back()["watched_plan"] = r.watched_plan_path;
    }
  }
  // What ampx's auto choice of CPU products measured (null where it timed
  // nothing: another device, a path set by AMPX_CPU_PRODUCTS, no 16-bit
  // kernels in LibTorch here).
  const auto products_dtype = c.dtype == "fp16" ? c10::kHalf : c10::kBFloat16;
  nlohmann::json products_probe;
  if (c.device == "cpu" && ampx::get_cpu_products() == ampx::CpuProducts::kAuto) {
    const auto& probe = ampx::cpu_products_probe(products_dtype);
    if (probe.native_kernels) {
      products_probe = {{"native_gflops", probe.native_gflops},
                        {"float32_gflops", probe.float32_gflops}};
    }
  }
  return {
      {"workload", workload.name()},
      {"baseline", base.mode},
      {"settings",
       {{"batch_size", c.batch_size},
        {"steps", results.front().steps},
        {"lr", c.lr},
        {"seed", c.seed},
        {"threads", c.threads},
        {"malloc", c.malloc},
        {"device", c.device},
        {"tf32", c.tf32},
        {"dtype", c.dtype},
        {"attention",
         is_gpt_workload(workload.name()) ? nlohmann::json(gpt_attention_of(c)) : nlohmann::json()},
        {"recompute",
         is_gpt_workload(workload.name()) ? nlohmann::json(c.recompute) : nlohmann::json()},
        {"cpu_products",
         c.device == "cpu"
             ? nlohmann::json(ampx::cpu_products_are_wide(products_dtype) ? "wide" : "native")
             : nlohmann::json()},
        {"cpu_products_probe", products_probe}}},
      {"machine",
       {{"cpu", cpu_model()}, {"blas", blas_library()}, {"libtorch", ampx::torch_version()}}},
      {"modes", modes},
  };
}

namespace {

/// The table with each mode's held-out loss (and metric) against the baseline's under it.
std::string table_with_parity(const Workload& workload, const std::vector<RunResult>& results) {
  const auto& base = baseline_of(results);
  std::ostringstream table;
  table << comparison_table(workload, results);
  // Accuracy kept: each mode's held-out result next to the baseline's.
  std::ostringstream parity;
  for (const auto& r : results) {
    if (&r == &base) continue;
    parity << (parity.tellp() > 0 ? ", " : "") << r.mode << " "
           << cell("%+.2f%%", 100 * (r.eval.loss / base.eval.loss - 1));
    if (workload.metric_is_percent())
      parity << cell(" (%+.2f points)", r.eval.metric - base.eval.metric);
  }
  if (parity.tellp() > 0) {
    table << "\ntest loss vs " << base.mode << ": " << parity.str() << "\n";
  }
  const std::string origins = memory_origins_table(results);
  if (!origins.empty()) table << "\nwhere each mode's peak came from:\n\n" << origins;
  return table.str();
}

/// Writes loss-<mode>.dat (each step's loss and its smoothed curve) for every
/// mode; returns gnuplot's plot clauses for those curves.
std::string write_loss_curves(const fs::path& out, const std::vector<RunResult>& results) {
  std::ostringstream curves;
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    const auto dat = out / ("loss-" + r.mode + ".dat");
    std::ostringstream f;
    f << "# step loss ema(0.95, bias-corrected)\n";
    double ema = 0, weight = 0;
    for (size_t s = 0; s < r.losses.size(); ++s) {
      ema = 0.95 * ema + 0.05 * r.losses[s];
      weight = 0.95 * weight + 0.05;
      f << s + 1 << " " << r.losses[s] << " " << ema / weight << "\n";
    }
    write_output_file(dat, f.str());
    curves << (i ? ", \\\n     " : "") << gnuplot_string(dat.filename().string())
           << " using 1:3 with lines lw 2 lc " << i + 1 << " title '" << r.mode << " (" << r.dtype
           << ")'";
  }
  return curves.str();
}

/// Writes throughput.dat and compare.gp, gnuplot's script of the loss curves
/// (`curves`, from write_loss_curves) beside the throughput bars.
void write_plot_script(const TrainConfig& c, const Workload& workload,
                       const std::vector<RunResult>& results, const fs::path& out,
                       const std::string& curves) {
  {
    std::ostringstream f;
    f << "# mode " << workload.unit() << "/s\n";
    for (const auto& r : results) f << r.mode << " " << r.items_per_s << "\n";
    write_output_file(out / "throughput.dat", f.str());
  }
  const auto script = out / "compare.gp";
  std::ostringstream f;
  f << "# gnuplot " << script.filename().string() << "  (run in this folder)\n"
    << "set terminal pngcairo size 1400,520 font ',11'\n"
    << "set output 'compare.png'\n"
    << "set multiplot layout 1,2 title 'ampx-train " << workload.name() << ": "
    << results.front().steps << " steps, batch " << c.batch_size << ", " << c.threads
    << " threads, LibTorch " << ampx::torch_version() << "'\n"
    << "set grid\nset key top right\n"
    << "set title 'training loss (EMA 0.95)'\nset xlabel 'step'\nset ylabel 'loss'\n"
    << "plot " << curves << "\n"
    << "set title 'throughput'\nset xlabel 'mode'\nset ylabel '" << workload.unit()
    << " per second'\n"
    << "set yrange [0:*]\nset boxwidth 0.6\nset style fill solid 0.8\nunset key\n"
    << "plot 'throughput.dat' using 0:2:xtic(1) with boxes lc rgb '#4878b0', \\\n"
    << "     '' using 0:2:(sprintf('%.0f', $2)) with labels offset 0,1\n"
    << "unset multiplot\n";
  write_output_file(script, f.str());
}

}  // namespace

Report write_report(const TrainConfig& c, const Workload& workload,
                    const std::vector<RunResult>& results) {
  const fs::path out = c.out_dir;
  fs::create_directories(out);
  Report report;
  report.table = table_with_parity(workload, results);

  std::ostringstream md;
  md << "# ampx-train: " << workload.name() << "\n\n"
     << results.size() << " modes, " << results.front().steps << " steps each, batch "
     << c.batch_size << ", seed " << c.seed << ", " << c.threads << " threads on " << c.device
     << " (" << cpu_model() << "), LibTorch " << ampx::torch_version() << ", " << blas_library()
     << ".\n\n"
     << report.table;
  report.markdown_path = (out / "compare.md").string();
  write_output_file(report.markdown_path, md.str());
  report.json_path = (out / "compare.json").string();
  write_output_file(report.json_path, comparison_json(c, workload, results).dump(2) + "\n");

  // gnuplot input: one smoothed loss curve per mode, one throughput bar each.
  write_plot_script(c, workload, results, out, write_loss_curves(out, results));
  report.plot_path = run_gnuplot(out.string(), "compare.gp", "compare.png", report.plot_note);
  return report;
}

}  // namespace ampx::train
