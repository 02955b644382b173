// The table ampx-train prints before it trains: what it will do, on what.
#include "config.h"
#include "precision/auto_precision.h"

#include "distributed/sharding.h"
#include "machine.h"
#include "reports/weights_export.h"
#include "run/optimizer_options.h"

#include <ampx/version.h>

#include <algorithm>
#include <iomanip>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace ampx::train {
namespace {

// "  key    value" rows, the values aligned by aligned().
class Rows {
 public:
  template <typename T>
  void add(const std::string& key, const T& value) {
    std::ostringstream s;
    s << value;
    rows_.emplace_back(key, s.str());
  }

  std::string aligned() const {
    size_t width = 0;
    for (const auto& r : rows_) width = std::max(width, r.first.size());
    std::ostringstream out;
    for (const auto& r : rows_) {
      out << "  " << std::left << std::setw(static_cast<int>(width)) << r.first << "  " << r.second
          << "\n";
    }
    return out.str();
  }

 private:
  std::vector<std::pair<std::string, std::string>> rows_;
};

// What runs where: workload, modes, device, processes, threads, memory.
void add_run_rows(const TrainConfig& c, Rows& rows) {
  std::string modes;
  for (const auto& m : modes_of(c)) modes += (modes.empty() ? "" : ",") + m;
  rows.add("workload", c.workload);
  if (!c.diagnose) {  // --diagnose trains --diagnose-steps fp32 steps, its own row says
    rows.add(c.compare.empty() ? "precision" : "compare", modes);
    rows.add("dtype", c.dtype);
  }
  rows.add("device", c.device);
  if (c.on_cuda()) {
    rows.add("tf32", c.tf32 ? "on (fp32 products and convolutions)" : "LibTorch's default");
  }
  if (c.nproc > 1) rows.add("processes", c.nproc);
  if (c.shard != "none") rows.add("sharding", shard_description(c));
  rows.add("threads", c.threads);
  rows.add("malloc", c.malloc == "keep" ? "keeps freed memory (mmap threshold 32 MiB, trim 1 GiB)"
                                        : "glibc's defaults");
}

// The optimization and the model's shape.
void add_schedule_rows(const TrainConfig& c, Rows& rows) {
  rows.add("batch size", c.batch_size);
  if (!c.diagnose && c.steps > 0) {
    rows.add("steps", c.steps);
  } else if (!c.diagnose) {
    rows.add("epochs", c.epochs);
  }
  rows.add("lr (AdamW)", c.lr);
  rows.add("weight decay", c.weight_decay);
  rows.add("optimizer", optimizer_description(c));
  rows.add("seed", c.seed);
  if (is_gpt_workload(c.workload)) {
    std::ostringstream shape;
    shape << c.layers << " layers, d " << c.d_model << ", " << c.heads << " heads, block "
          << c.block_size;
    rows.add("model", shape.str());
    rows.add("attention", gpt_attention_of(c));
    if (c.recompute != "none") rows.add("recompute", recompute_description(c));
  }
  rows.add("data", c.data_dir);
  rows.add("output", c.out_dir);
}

// Diagnostics, the auto plan and each FP8 mode's recipe.
void add_numerics_rows(const TrainConfig& c, Rows& rows) {
  if (c.diagnose) {
    rows.add("diagnose", std::to_string(c.diagnose_steps) +
                             " fp32 steps under range statistics, then the precision advice");
  }
  if (!c.detect_nonfinite.empty()) {
    rows.add("non-finite check",
             c.detect_nonfinite + (c.detect_nonfinite == "throw"
                                       ? " (stop at the first inf/NaN of forward or backward)"
                                       : " (report inf/NaN of forward and backward, go on)"));
  }
  for (const auto& mode : modes_of(c)) {
    if (mode == "auto") {
      std::string plan = c.precision_plan;
      if (plan.empty() && c.resume) {
        plan = "the one its checkpoint trained with";
      } else if (plan.empty()) {
        plan = "measured: loss budget " + c.loss_budget + " against " + c.plan_reference +
               ", target " + c.target + ", " + std::to_string(c.plan_steps) +
               " steps a probe, " +
               (parse_tail(c.plan_tail, "--plan-tail") > 0
                    ? "the last " + c.plan_tail + " of steps in " + c.plan_reference
                    : std::string("no tail")) +
               (c.plan_ends == "none" ? ", no floor at the ends"
                                      : ", first and last blocks " + c.plan_ends + " or wider");
      }
      rows.add("auto plan", plan);
      rows.add("plan watch", c.plan_watch > 0
                                 ? "every " + std::to_string(c.plan_watch) +
                                       " steps against bf16 (left out of the timing), " +
                                       (c.plan_widen ? "moves a reported layer wider" : "reports")
                                 : std::string("off"));
      continue;
    }
    if (!is_fp8_mode(mode)) continue;
    const auto recipe = fp8_recipe_of(c, mode);
    rows.add(mode + " recipe",
             recipe.to_string() + (c.device == "cpu" ? ", emulated" : "") +
                 (recipe.is_block() || c.bf16_layers != "auto" ? "; bf16 layers: " + c.bf16_layers
                                                               : "") +
                 (parse_tail(c.fp8_tail, "--fp8-tail") > 0
                      ? "; the last " + c.fp8_tail + " of steps in " + c.dtype
                      : std::string()));
  }
  if (c.range_stats) {
    rows.add("range statistics", "collected (slower), " + c.out_dir + "/range-stats-<mode>.json");
  }
}

// Checkpoints and exported weights.
void add_output_rows(const TrainConfig& c, Rows& rows) {
  if (c.save_every > 0 || c.resume) {
    rows.add("checkpoints",
             c.checkpoint_dir + (c.save_every > 0 ? " (every " + std::to_string(c.save_every) + ")"
                                                  : std::string()));
  }
  if (c.resume) rows.add("resume", "yes");
  if (!c.export_weights.empty()) {
    rows.add("export weights",
             export_path_for(c, c.compare.empty() ? modes_of(c).front() : "<mode>"));
  }
}

// The LibTorch, BLAS and CPU kernels the run gets.
void add_platform_rows(const TrainConfig& c, Rows& rows) {
  rows.add("LibTorch", ampx::torch_version());
  rows.add("BLAS (fp32)", blas_setting());
  if (c.device == "cpu") {
    const auto dtype = c.dtype == "fp16" ? c10::kHalf : c10::kBFloat16;
    // (at most 12 characters: the table's width, which tests read)
    rows.add(std::string(c.dtype == "fp16" ? "fp16" : "bf16") + " matmuls",
             cpu_products_setting(dtype));
  }
  rows.add("CPU", cpu_model());
}

}  // namespace

std::string settings_table(const TrainConfig& c) {
  Rows rows;
  add_run_rows(c, rows);
  add_schedule_rows(c, rows);
  add_numerics_rows(c, rows);
  add_output_rows(c, rows);
  add_platform_rows(c, rows);
  return rows.aligned();
}

}  // namespace ampx::train
