#pragma once

// The comparison a --compare run ends with: a table on the console, the same
// table as markdown and JSON, and a PNG (gnuplot) of every mode's loss curve
// and throughput.
//
//   Report report = write_report(config, workload, results);
//   std::cout << report.table;   // report.markdown_path, .json_path, .plot_path

#include "cli/config.h"
#include "run/trainer.h"
#include "run/workloads.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace ampx::train {

struct Report {
  std::string table;          // the console table plus a parity line
  std::string markdown_path;  // <out-dir>/compare.md
  std::string json_path;      // <out-dir>/compare.json
  std::string plot_path;      // <out-dir>/compare.png, empty when gnuplot failed or is missing
  std::string plot_note;      // why there is no plot
};

/// The table alone (markdown; the console shows it as is).
std::string comparison_table(const Workload& workload, const std::vector<RunResult>& results);

/// One JSON document: settings, machine, and one object per mode.
nlohmann::json comparison_json(const TrainConfig& config, const Workload& workload,
                               const std::vector<RunResult>& results);

/// Writes compare.md, compare.json, the plot's data and script, and runs
/// gnuplot (if it is installed) to draw compare.png.
Report write_report(const TrainConfig& config, const Workload& workload,
                    const std::vector<RunResult>& results);

}  // namespace ampx::train
