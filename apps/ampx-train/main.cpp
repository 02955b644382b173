// ampx-train: trains a reference workload on real data in one or more
// precision modes and shows what each buys. See `ampx-train --help` and the
// README.
//
//   ampx-train --workload gpt --compare fp32,O1,O2
//   ampx-train --workload mnist-cnn --precision O2 --save-every 100
//   ampx-train --workload mnist-cnn --precision O2 --save-every 100 --resume

#include "config.h"
#include "device_memory.h"
#include "report.h"
#include "trainer.h"
#include "workloads.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <exception>
#include <iostream>

namespace {

int run(int argc, char** argv) {
  using namespace ampx::train;
  TrainConfig config;
  if (auto code = parse_command_line(argc, argv, config)) return *code;
  resolve_defaults(config);
  at::set_num_threads(config.threads);
  const torch::Device device(config.device == "cuda" ? torch::kCUDA : torch::kCPU);
  enable_memory_tracking(device);

  std::cout << "ampx-train\n" << settings_table(config) << std::flush;
  auto workload = make_workload(config);
  if (config.epochs > 0) {
    std::cout << "  (" << workload->steps_per_epoch() << " steps per epoch)\n";
  }
  std::cout << std::endl;

  std::vector<RunResult> results;
  for (const auto& mode : modes_of(config)) {
    RunResult r = train_mode(config, *workload, mode);
    std::printf(
        "[%s] done: %.0f %s/s, median step %.1f ms, peak %.1f MiB, test loss %.4f, %s %.3f\n",
        mode.c_str(), r.items_per_s, workload->unit().c_str(), r.median_step_ms,
        r.peak_bytes / 1048576.0, r.eval.loss, workload->metric_name().c_str(), r.eval.metric);
    if (!r.checkpoint_path.empty())
      std::printf("[%s] checkpoint: %s\n", mode.c_str(), r.checkpoint_path.c_str());
    std::fflush(stdout);
    results.push_back(std::move(r));
  }

  const Report report = write_report(config, *workload, results);
  std::cout << "\n" << report.table << "\n";
  std::cout << "table:   " << report.markdown_path << "\n"
            << "json:    " << report.json_path << "\n";
  if (!report.plot_path.empty()) {
    std::cout << "plot:    " << report.plot_path << "\n";
  } else {
    std::cout << "plot:    none: " << report.plot_note << "\n";
  }
  std::cout << "metrics: " << results.front().metrics_path
            << (results.size() > 1 ? " (one file per mode)" : "") << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::cout << std::flush;
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::cout << std::flush;
    std::fprintf(stderr, "ampx-train: %s\n", e.what());
  }
  return 1;
}
