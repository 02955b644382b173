// ampx-train: trains a reference workload on real data in one or more
// precision modes and shows what each buys. See `ampx-train --help` and
// docs/ampx-train.md.
//
//   ampx-train --workload gpt --compare fp32,O1,O2
//   ampx-train --workload mnist-cnn --precision O2 --save-every 100
//   ampx-train --workload mnist-cnn --precision O2 --save-every 100 --resume
//
// --compare trains each mode in a process of its own (this binary again, with
// --only-mode): every mode starts from the same clean state, so lazily made
// caches and allocator history of one mode do not flatter or burden the next.

#include "config.h"
#include "device_memory.h"
#include "machine.h"
#include "report.h"
#include "trainer.h"
#include "workloads.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <spawn.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>

extern char** environ;

namespace {

namespace fs = std::filesystem;
using namespace ampx::train;

/// Runs this binary again with `argv` plus `extra`; returns its exit status.
int run_child(int argc, char** argv, const std::vector<std::string>& extra) {
  std::vector<char*> args(argv, argv + argc);
  for (const auto& e : extra) args.push_back(const_cast<char*>(e.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int err = ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, args.data(), environ);
  TORCH_CHECK(err == 0, "ampx-train: cannot start a training process: ", std::strerror(err));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    TORCH_CHECK(errno == EINTR, "ampx-train: waitpid failed: ", std::strerror(errno));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

void print_done(const Workload& workload, const RunResult& r) {
  std::printf("[%s] done: %.0f %s/s, median step %.1f ms, peak %.1f MiB, test loss %.4f, %s %.3f\n",
              r.mode.c_str(), r.items_per_s, workload.unit().c_str(), r.median_step_ms,
              r.peak_bytes / 1048576.0, r.eval.loss, workload.metric_name().c_str(), r.eval.metric);
  if (!r.profile_summary.empty()) std::printf("%s", r.profile_summary.c_str());
  if (!r.checkpoint_path.empty()) {
    std::printf("[%s] checkpoint: %s\n", r.mode.c_str(), r.checkpoint_path.c_str());
  }
  std::fflush(stdout);
}

int run(int argc, char** argv) {
  TrainConfig config;
  if (auto code = parse_command_line(argc, argv, config)) return *code;
  resolve_defaults(config);
  at::set_num_threads(config.threads);
  const torch::Device device(config.device == "cuda" ? torch::kCUDA : torch::kCPU);
  enable_memory_tracking(device);
  const bool child = !config.only_mode.empty();
  const auto modes = modes_of(config);

  if (!child) {
    std::cout << "ampx-train\n" << settings_table(config) << std::flush;
    if (const auto warning = blas_warning(config.threads); !warning.empty()) {
      std::cout << warning << "\n";
    }
  }
  auto workload = make_workload(config);  // loads the data: missing data fails here
  if (!child) {
    if (config.epochs > 0)
      std::cout << "  (" << workload->steps_per_epoch() << " steps per epoch)\n";
    std::cout << std::endl;
  }

  if (modes.size() == 1) {
    const RunResult r = train_mode(config, *workload, modes.front());
    print_done(*workload, r);
    if (!config.result_file.empty()) {
      std::ofstream(config.result_file) << to_json(r).dump() << "\n";
    }
    if (child) return 0;
    const Report report = write_report(config, *workload, {r});
    std::cout << "\nsummary: " << report.json_path << "\nmetrics: " << r.metrics_path << std::endl;
    return 0;
  }

  std::vector<RunResult> results;
  fs::create_directories(config.out_dir);
  for (const auto& mode : modes) {
    const auto result_file = fs::path(config.out_dir) / ("result-" + mode + ".json");
    fs::remove(result_file);
    const int code =
        run_child(argc, argv, {"--only-mode", mode, "--result-file", result_file.string()});
    TORCH_CHECK(code == 0 && fs::exists(result_file), "ampx-train: training ", mode,
                " failed (exit status ", code, "); see its messages above");
    std::ifstream in(result_file);
    results.push_back(run_result_from_json(nlohmann::json::parse(in)));
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
  std::cout << "metrics: " << results.front().metrics_path << " (one file per mode)" << std::endl;
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
