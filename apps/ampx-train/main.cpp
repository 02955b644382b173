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

#include "ampx/dist.h"
#include "ampx/kernels.h"
#include "ampx/memory.h"

#include "cli/config.h"
#include "distributed/processes.h"
#include "distributed/rank_agreement.h"
#include "machine.h"
#include "precision/auto_precision.h"
#include "reports/diagnose.h"
#include "reports/output_file.h"
#include "reports/report.h"
#include "run/device_memory.h"
#include "run/preemption.h"
#include "run/step_diagnostics.h"
#include "run/trainer.h"
#include "run/workloads.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>

namespace {

namespace fs = std::filesystem;
using namespace ampx::train;

/// What this process is in a run.
enum class Role {
  kMain,          // the user started it: shows the settings, then trains, or
                  // starts a process per mode (--compare) or per rank (--nproc)
  kModeProcess,   // one mode of a --compare run (--only-mode); reports to its parent
  kRank,          // one rank of --nproc, started by this binary
  kExternalRank,  // one rank an outside launcher (torchrun) started
};

std::string host_name() {
  char name[256] = {0};
  return ::gethostname(name, sizeof(name) - 1) == 0 ? name : "?";
}

Role role_of(const TrainConfig& config) {
  if (ampx::dist::launched_as_rank()) {  // ours carry --nproc or --only-mode
    return config.nproc > 1 || !config.only_mode.empty() ? Role::kRank : Role::kExternalRank;
  }
  return config.only_mode.empty() ? Role::kMain : Role::kModeProcess;
}

/// One line per rank at the start: where it runs and what it uses.
void print_placement(const ampx::dist::LaunchEnv& env, const ampx::dist::ProcessGroup& group,
                     int threads) {
  std::printf(
      "rank %lld of %lld (%s): host '%s'%s, local rank %lld of %lld, %d thread%s, Gloo on %s\n",
      static_cast<long long>(group.rank()), static_cast<long long>(group.world_size()),
      env.launcher.c_str(), host_name().c_str(),
      env.node_rank >= 0 ? (" (node " + std::to_string(env.node_rank) + ")").c_str() : "",
      static_cast<long long>(env.local_rank), static_cast<long long>(env.local_world_size), threads,
      threads == 1 ? "" : "s", group.gloo_endpoint().c_str());
  std::fflush(stdout);
}

void print_done(const Workload& workload, const RunResult& r) {
  std::printf("[%s] done: %.0f %s/s, median step %.1f ms, peak %.1f MiB, test loss %.4f, %s\n",
              r.mode.c_str(), r.items_per_s, workload.unit().c_str(), r.median_step_ms,
              r.peak_bytes / 1048576.0, r.eval.loss,
              workload.describe_metric(r.eval.metric).c_str());
  if (!r.profile_summary.empty()) std::printf("%s", r.profile_summary.c_str());
  if (!r.checkpoint_path.empty()) {
    std::printf("[%s] checkpoint: %s\n", r.mode.c_str(), r.checkpoint_path.c_str());
  }
  if (!r.weights_path.empty()) {
    std::printf("[%s] weights (safetensors): %s\n", r.mode.c_str(), r.weights_path.c_str());
  }
  if (!r.nonfinite_summary.empty()) {
    std::printf("[%s] %s\n", r.mode.c_str(), r.nonfinite_summary.c_str());
  }
  if (!r.fp8_trace_path.empty()) {
    std::printf("[%s] fp8 amax and scale trajectory: %s\n", r.mode.c_str(),
                r.fp8_trace_path.c_str());
  }
  if (!r.range_stats_path.empty()) {
    std::printf("[%s] range statistics: %s\n", r.mode.c_str(), r.range_stats_path.c_str());
  }
  if (!r.plan_watch.empty()) {
    std::printf("[%s] plan watch: %zu finding(s), the first: %s\n", r.mode.c_str(),
                r.plan_watch.size(), r.plan_watch.front().c_str());
  }
  if (!r.watched_plan_path.empty()) {
    std::printf("[%s] the plan as the watch left it: %s\n", r.mode.c_str(),
                r.watched_plan_path.c_str());
  }
  std::fflush(stdout);
}

/// After a preemption signal stopped training: says where each rank
/// stopped and where the checkpoint is; returns kExitPreempted.
int report_preemption(const RunResult& r, const ampx::dist::ProcessGroup* group) {
  const int signal = preemption_signal();
  const std::string why =
      signal != 0 ? signal_name(signal) : std::string("a preemption signal to another rank");
  const std::string who = group ? " rank " + std::to_string(group->rank()) + ":" : "";
  std::cout << std::flush;
  std::fprintf(stderr, "[%s]%s %s: stopped after step %lld\n", r.mode.c_str(), who.c_str(),
               why.c_str(), static_cast<long long>(r.preempted_after));
  if (!group || group->rank() == 0) {
    std::fprintf(stderr,
                 "[%s] checkpoint: %s (continue with --resume); exit status %d (preempted)\n",
                 r.mode.c_str(), r.checkpoint_path.c_str(), kExitPreempted);
  }
  return kExitPreempted;
}

/// The settings table (and a word on the BLAS build) at the start of a run.
/// At the run's thread count: the table's products line times them
/// (ampx::cpu_products_probe) on the first call.
void show_settings(const TrainConfig& config) {
  at::set_num_threads(config.threads);
  std::cout << "ampx-train\n" << settings_table(config) << std::flush;
  if (const auto warning = blas_warning(config.threads); !warning.empty()) {
    std::cout << warning << "\n";
  }
}

/// What every process that trains does first: threads, the allocator,
/// memory tracking, then the data (missing data fails here).
std::unique_ptr<Workload> prepare(const TrainConfig& config, bool show) {
  at::set_num_threads(config.threads);
  // How 16-bit CPU products run is timed once (ampx::cpu_products_probe):
  // here, at the run's thread count and before memory is tracked, not in the
  // first mixed mode, whose peak would count the probe's matrices.
  if (config.device == "cpu") {
    ampx::cpu_products_are_wide(config.dtype == "fp16" ? c10::kHalf : c10::kBFloat16);
  }
  if (config.malloc == "keep") {
    if (const auto kept = ampx::keep_freed_cpu_memory(); !kept.applied && show) {
      std::cout << "malloc: glibc's defaults stay: " << kept.reason << "\n";
    }
  }
  enable_memory_tracking(config.torch_device());
  auto workload = make_workload(config);
  if (show) {
    if (config.epochs > 0)
      std::cout << "  (" << workload->steps_per_epoch() << " steps per epoch)\n";
    std::cout << std::endl;
  }
  return workload;
}

/// --diagnose: a short fp32 run's advice, and where its report is.
int print_diagnosis(const TrainConfig& config, Workload& workload) {
  const Diagnosis d = diagnose(config, workload);
  std::cout << d.advice_markdown << "\n"
            << "report:  " << d.markdown_path << "\n"
            << "json:    " << d.json_path << "\n";
  if (!d.plot_path.empty()) {
    std::cout << "plot:    " << d.plot_path << "\n";
  } else {
    std::cout << "plot:    none: " << d.plot_note << "\n";
  }
  std::cout << std::flush;
  return 0;
}

/// One mode in this process, a rank of `group` if there is one: trains,
/// prints the result and writes --result-file; the report too, unless a
/// --compare parent makes it.
int train_one(const TrainConfig& config, Workload& workload, const std::string& mode,
              const ampx::dist::ProcessGroup* group) {
  const RunResult r = train_mode(config, workload, mode, group);
  if (r.preempted_after > 0) return report_preemption(r, group);
  if (group) {
    std::printf("[%s] rank %lld of %lld: weights %s\n", r.mode.c_str(),
                static_cast<long long>(group->rank()), static_cast<long long>(group->world_size()),
                r.weights_checksum.c_str());
    std::fflush(stdout);
    if (group->rank() != 0) return 0;
  }
  print_done(workload, r);
  if (!config.result_file.empty()) {
    write_output_file(config.result_file, to_json(r).dump() + "\n");
  }
  if (!config.only_mode.empty()) return 0;  // the --compare parent reports
  const Report report = write_report(config, workload, {r});
  std::cout << "\nsummary: " << report.json_path << "\nmetrics: " << r.metrics_path << std::endl;
  return 0;
}

/// --compare: each mode in a process of its own (--only-mode), one after
/// another, then the report of them all.
int compare(int argc, char** argv, const TrainConfig& config, Workload& workload,
            const std::vector<std::string>& modes, const std::string& measured_plan) {
  // --precision auto's plan, measured once here, is applied by its child.
  std::vector<std::string> plan_args;
  if (!measured_plan.empty()) plan_args = {"--precision-plan", measured_plan};
  std::vector<RunResult> results;
  fs::create_directories(config.out_dir);
  for (const auto& mode : modes) {
    if (const int signal = preemption_signal(); signal != 0) {
      std::fprintf(stderr, "ampx-train: %s: the comparison stops before %s\n",
                   signal_name(signal).c_str(), mode.c_str());
      return kExitPreempted;
    }
    const auto result_file = fs::path(config.out_dir) / ("result-" + mode + ".json");
    fs::remove(result_file);
    std::vector<std::string> extra = {"--only-mode", mode, "--result-file", result_file.string()};
    if (mode == "auto") extra.insert(extra.end(), plan_args.begin(), plan_args.end());
    const int code = run_child(argc, argv, extra);
    if (code == kExitNonFinite) {  // its report is above
      std::fprintf(stderr, "ampx-train: --detect-nonfinite stopped %s; the comparison ends here\n",
                   mode.c_str());
      return kExitNonFinite;
    }
    if (code == kExitPreempted) {  // its checkpoint and message are above
      std::fprintf(stderr, "ampx-train: %s was preempted; the comparison ends here\n",
                   mode.c_str());
      return kExitPreempted;
    }
    TORCH_CHECK(code == 0 && fs::exists(result_file), "ampx-train: training ", mode,
                " failed (exit status ", code, "); see its messages above");
    std::ifstream in(result_file);
    results.push_back(run_result_from_json(nlohmann::json::parse(in)));
  }

  const Report report = write_report(config, workload, results);
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

/// A rank's copy of the plan rank 0 measured, in a file of its own (the
/// ranks may not share a file system), removed when the rank is done.
class RankPlanFile {
 public:
  explicit RankPlanFile(const std::string& text) {
    path_ = (fs::temp_directory_path() / "ampx-train-plan-XXXXXX").string();
    const int fd = ::mkstemp(path_.data());
    TORCH_CHECK(fd >= 0, "ampx-train: cannot make a file for rank 0's plan in ",
                fs::temp_directory_path().string(), ": ", std::strerror(errno));
    ::close(fd);
    write_output_file(path_, text);
  }
  ~RankPlanFile() {
    std::error_code ignored;
    fs::remove(path_, ignored);
  }
  RankPlanFile(const RankPlanFile&) = delete;
  RankPlanFile& operator=(const RankPlanFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// What the process trains once it knows its place: a diagnosis, one mode,
/// or a comparison. `group`: the ranks of a data-parallel run.
int train(int argc, char** argv, TrainConfig config, Workload& workload,
          const ampx::dist::ProcessGroup* group) {
  const auto modes = modes_of(config);
  if (config.diagnose) return print_diagnosis(config, workload);
  // --precision auto without --precision-plan, on ranks an outside launcher
  // (torchrun) started: rank 0 measures (or, resuming, takes the plan the
  // checkpoint trained with) while the others wait, and hands them its plan.
  std::optional<RankPlanFile> rank_plan;
  if (group && modes.size() == 1 && modes.front() == "auto" && config.precision_plan.empty()) {
    std::string path;
    const std::string text = from_rank0(group, [&] {
      path = config.resume ? resumed_plan(config) : plan_precision(config, workload);
      return read_plan_text(path);
    });
    if (group->rank() != 0) path = rank_plan.emplace(text).path();
    config.precision_plan = path;
  }
  // --precision auto without --precision-plan: measure and plan first (or,
  // resuming, take the plan the checkpoint trained with).
  std::string measured_plan;
  if (std::find(modes.begin(), modes.end(), "auto") != modes.end() &&
      config.precision_plan.empty()) {
    config.precision_plan = measured_plan =
        config.resume ? resumed_plan(config) : plan_precision(config, workload);
    if (modes.size() > 1) release_cached_memory(config.torch_device());  // for the children
  }
  if (modes.size() == 1) return train_one(config, workload, modes.front(), group);
  return compare(argc, argv, config, workload, modes, measured_plan);
}

/// A process that starts others (--compare's modes, --nproc's ranks) hands
/// them its choice of 16-bit CPU products in AMPX_CPU_PRODUCTS, so that
/// they all multiply as it timed them to rather than each timing anew.
void hand_cpu_products_to_children(const TrainConfig& config) {
  const auto modes = modes_of(config);
  if (config.device != "cpu" || config.diagnose || (modes.size() == 1 && config.nproc == 1)) {
    return;
  }
  std::vector<c10::ScalarType> dtypes;
  for (const auto& name : modes) {
    const Mode mode = parse_mode(name, config);
    if (mode.mixed()) dtypes.push_back(mode.dtype);
  }
  at::set_num_threads(config.threads);  // the thread count the children train at
  const std::string value = cpu_products_for_children(dtypes);
  if (!value.empty()) ::setenv("AMPX_CPU_PRODUCTS", value.c_str(), 1);
}

/// Role::kMain and Role::kModeProcess: a process of its own, which starts
/// --nproc's ranks when asked for them.
int run_process(int argc, char** argv, const TrainConfig& config, bool show) {
  if (show) show_settings(config);
  hand_cpu_products_to_children(config);
  // A diagnosis is short and writes no checkpoint: a signal ends it as usual.
  if (!config.diagnose) install_preemption_handlers();
  const auto modes = modes_of(config);
  if (modes.size() == 1 && config.nproc > 1) {
    std::cout << std::endl;
    if (modes.front() != "auto" || !config.precision_plan.empty()) {
      return run_ranks(argc, argv, config.nproc);
    }
    // --precision auto: measured here, once (at the ranks' thread count, at
    // which --target cpu times the formats), and the plan handed to every
    // rank; the workload and the device's cached memory freed before they start.
    std::string plan;
    if (config.resume) {
      plan = resumed_plan(config);
    } else {
      auto workload = prepare(config, show);
      plan = plan_precision(config, *workload);
    }
    release_cached_memory(config.torch_device());
    if (const int signal = preemption_signal(); signal != 0) {
      std::fprintf(stderr, "ampx-train: %s: the run stops after measuring its plan (%s)\n",
                   signal_name(signal).c_str(), plan.c_str());
      return kExitPreempted;
    }
    return run_ranks(argc, argv, config.nproc, {"--precision-plan", plan});
  }
  auto workload = prepare(config, show);
  return train(argc, argv, config, *workload, nullptr);
}

/// Role::kRank and Role::kExternalRank: one rank of a data-parallel run,
/// started by --nproc or by an outside launcher (torchrun), which then also
/// says how many ranks there are; rank 0 alone shows the settings.
int run_rank(int argc, char** argv, TrainConfig config, Role role) {
  bool show = false;
  if (role == Role::kExternalRank) {
    const auto env = ampx::dist::launch_env_from_environment();
    config.nproc = static_cast<int>(env.world_size);
    show = env.rank == 0;
  }
  if (show) show_settings(config);
  if (!config.diagnose) install_preemption_handlers();
  std::optional<ampx::dist::ProcessGroup> group;
  if (modes_of(config).size() == 1) {  // --compare's modes each meet in a child of their own
    const auto env = ampx::dist::launch_env_from_environment();
    auto options = ampx::dist::InitOptions().timeout(
        std::chrono::milliseconds(static_cast<int64_t>(config.dist_timeout * 1000)));
    const char* store_file = std::getenv(kStoreFileEnv);
    if (role == Role::kRank && store_file != nullptr) options.store_file(store_file);
    group.emplace(ampx::dist::init_process_group(env, options));
    print_placement(env, *group, config.threads);
    const Mode mode = parse_mode(modes_of(config).front(), config);
    if (config.device == "cpu" && mode.mixed() &&
        ampx::get_cpu_products() == ampx::CpuProducts::kAuto) {
      // Ranks an outside launcher started multiply as rank 0 timed its products to.
      at::set_num_threads(config.threads);
      const std::string wide = from_rank0(
          &*group, [&] { return std::string(ampx::cpu_products_are_wide(mode.dtype) ? "1" : ""); });
      ampx::set_cpu_products(wide.empty() ? ampx::CpuProducts::kNative : ampx::CpuProducts::kWide);
    }
  }
  auto workload = prepare(config, show && (!group || group->rank() == 0));
  return train(argc, argv, config, *workload, group ? &*group : nullptr);
}

int run(int argc, char** argv) {
  TrainConfig config;
  if (auto code = parse_command_line(argc, argv, config)) return *code;
  resolve_defaults(config);
  const Role role = role_of(config);
  switch (role) {
    case Role::kMain:
    case Role::kModeProcess:
      return run_process(argc, argv, config, /*show=*/role == Role::kMain);
    case Role::kRank:
    case Role::kExternalRank:
      return run_rank(argc, argv, config, role);
  }
  return 1;
}

/// Executes this binary again with OpenBLAS's OpenMP build first on
/// LD_LIBRARY_PATH when blas_dir_to_switch_to() names it (machine.h), before
/// anything ran on the pthreads build: a run, every mode of --compare and
/// every rank then train on it. Returns only when there is nothing to switch,
/// or when the exec failed (the run goes on, and says which build it has).
void switch_blas(char** argv) {
  const std::string dir = blas_dir_to_switch_to();
  if (dir.empty()) return;
  const char* old = std::getenv("LD_LIBRARY_PATH");
  const std::optional<std::string> old_path = old ? std::optional<std::string>(old) : std::nullopt;
  ::setenv("LD_LIBRARY_PATH",
           (old_path && !old_path->empty() ? dir + ":" + *old_path : dir).c_str(), 1);
  ::setenv(kBlasSwitchedEnv, dir.c_str(), 1);
  ::execv("/proc/self/exe", argv);
  if (old_path) {
    ::setenv("LD_LIBRARY_PATH", old_path->c_str(), 1);
  } else {
    ::unsetenv("LD_LIBRARY_PATH");
  }
  ::unsetenv(kBlasSwitchedEnv);
}

}  // namespace

int main(int argc, char** argv) {
  switch_blas(argv);
  try {
    return run(argc, argv);
  } catch (const ampx::debug::NonFiniteError& e) {
    std::cout << std::flush;
    std::fprintf(stderr, "%s\n", nonfinite_stop_message(e).c_str());
    return kExitNonFinite;
  } catch (const c10::Error& e) {
    std::cout << std::flush;
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::cout << std::flush;
    std::fprintf(stderr, "ampx-train: %s\n", e.what());
  }
  return 1;
}
