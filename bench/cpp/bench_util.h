#pragma once

// What the Google Benchmark programs in bench/ share: the --elements=N flag,
// the counters a harness needs to recompute every closing table from
// --benchmark_out=FILE --benchmark_out_format=json, and a console reporter
// that collects the runs and prints such a table at the end.
//
//   const auto flags = ampx::bench::initialize(argc, argv, 100'000'000);  // + --elements=N
//   ampx::bench::print_header(flags, "LibTorch %s\n", ...);
//   ampx::bench::run_with_table(flags, [](const ampx::bench::Table& t) { ... });
//
// Every bandwidth benchmark sets bytes_per_second (the bytes it is credited
// per iteration over the real time) and the counters `threads` and
// `bytes_per_iter` (and `elements`), so a ratio in a table is the same
// quotient of two JSON entries: kernel bytes_per_second / BM_Copy's at the
// same thread count (benchmark names are "BM_Kernel/<threads>/...").

#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

namespace ampx {
namespace bench {

/// What main() reads from the command line besides Google Benchmark's flags.
struct Flags {
  int64_t elements = 0;   // --elements=N, removed from argv
  bool console = true;    // stdout gets the console format (no --benchmark_format=json/csv)
  bool min_time = false;  // --benchmark_min_time given
};

/// Reads --elements=N (`default_elements` without it) and the output format,
/// then hands the rest of argv to benchmark::Initialize (which consumes its flags).
inline Flags initialize(int& argc, char** argv, int64_t default_elements) {
  Flags flags;
  flags.elements = default_elements;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--elements=", 11) == 0) {
      flags.elements = std::atoll(argv[i] + 11);
      continue;
    }
    if (std::strncmp(argv[i], "--benchmark_format=", 19) == 0) {
      flags.console = std::strcmp(argv[i] + 19, "console") == 0;
    }
    flags.min_time = flags.min_time || std::strncmp(argv[i], "--benchmark_min_time=", 21) == 0;
    argv[kept++] = argv[i];
  }
  argc = kept;
  benchmark::Initialize(&argc, argv);
  return flags;
}

/// Real time in `unit`, at least `seconds` per benchmark unless the command
/// line gave --benchmark_min_time (a benchmark's own MinTime would silently
/// override the flag, so benchmarks are registered in main, after the flags).
inline benchmark::internal::Benchmark* timed(benchmark::internal::Benchmark* b, const Flags& flags,
                                             benchmark::TimeUnit unit, double seconds) {
  b->Unit(unit)->UseRealTime();
  if (!flags.min_time) b->MinTime(seconds);
  return b;
}

/// Credits `bytes` per iteration and records the counters the tables read.
inline void set_traffic(benchmark::State& state, int64_t bytes, int64_t elements, int threads) {
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["threads"] = threads;
  state.counters["elements"] = static_cast<double>(elements);
  state.counters["bytes_per_iter"] = static_cast<double>(bytes);
}

/// One benchmark's result as the closing tables read it.
struct Result {
  double ms = 0;    // real time per iteration
  double gbps = 0;  // bytes_per_second / 1e9; 0 if the benchmark credits no bytes
  std::map<std::string, double> counters;
};

/// Results by argument string ("2" for BM_Copy/2, "1/0" for two arguments),
/// then by function name ("BM_Copy").
using Table = std::map<std::string, std::map<std::string, Result>>;

/// The console reporter plus a closing table printed by `print_table` once
/// every benchmark has run. Repeated runs keep the median aggregate.
class TableReporter : public benchmark::ConsoleReporter {
 public:
  explicit TableReporter(std::function<void(const Table&)> print_table)
      : ConsoleReporter(isatty(STDOUT_FILENO) ? OO_ColorTabular : OO_Tabular),
        print_table_(std::move(print_table)) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& run : runs) {
      if (run.run_type == Run::RT_Aggregate && run.aggregate_name != "median") continue;
      Result r;
      r.ms = run.GetAdjustedRealTime() / benchmark::GetTimeUnitMultiplier(run.time_unit) * 1e3;
      for (const auto& c : run.counters) r.counters[c.first] = c.second.value;
      const auto it = r.counters.find("bytes_per_second");
      if (it != r.counters.end()) r.gbps = it->second / 1e9;
      table_[run.run_name.args][run.run_name.function_name] = r;
    }
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\n");
    print_table_(table_);
    std::fflush(stdout);
  }

 private:
  std::function<void(const Table&)> print_table_;
  Table table_;
};

/// Runs the registered benchmarks; in the console format with the closing
/// table, otherwise with the reporter the flags ask for (stdout stays pure
/// JSON/CSV). --benchmark_out files are written either way.
inline void run_with_table(const Flags& flags, std::function<void(const Table&)> print_table) {
  if (flags.console) {
    TableReporter reporter(std::move(print_table));
    benchmark::RunSpecifiedBenchmarks(&reporter);
  } else {
    benchmark::RunSpecifiedBenchmarks();
  }
  benchmark::Shutdown();
}

/// `printf` to stdout in the console format, to stderr otherwise.
template <class... Args>
void print_header(const Flags& flags, const char* format, Args... args) {
  std::fprintf(flags.console ? stdout : stderr, format, args...);
}

/// A result by name, or nullptr.
inline const Result* find(const std::map<std::string, Result>& row, const std::string& name) {
  const auto it = row.find(name);
  return it == row.end() ? nullptr : &it->second;
}

/// Bandwidth table: every row's GB/s against `copy`'s at the same arguments.
inline void print_bandwidth_table(const Table& table, const std::string& copy) {
  std::printf("%-32s %8s %8s %10s %9s\n", "kernel", "threads", "GB/s", "copy GB/s", "vs copy");
  for (const auto& entry : table) {
    const Result* base = find(entry.second, copy);
    for (const auto& kernel : entry.second) {
      if (kernel.first == copy || kernel.second.gbps == 0) continue;
      if (base == nullptr || base->gbps == 0) {
        std::printf("%-32s %8s %8.2f %10s %9s\n", kernel.first.c_str(), entry.first.c_str(),
                    kernel.second.gbps, "-", "-");
      } else {
        std::printf("%-32s %8s %8.2f %10.2f %8.0f%%\n", kernel.first.c_str(), entry.first.c_str(),
                    kernel.second.gbps, base->gbps, 100.0 * kernel.second.gbps / base->gbps);
      }
    }
  }
}

/// Optimizer table per thread count: ampx's bandwidth against the copy's and
/// its step time against LibTorch's.
inline void print_optimizer_table(const Table& table, const std::string& copy,
                                  const std::string& ampx, const std::string& torch) {
  std::printf("%-8s %10s %12s %9s %14s %14s %9s\n", "threads", "copy GB/s", "ampx GB/s", "vs copy",
              "ampx ms/step", "torch ms/step", "speedup");
  for (const auto& entry : table) {
    const Result* c = find(entry.second, copy);
    const Result* a = find(entry.second, ampx);
    const Result* t = find(entry.second, torch);
    if (a == nullptr) continue;
    const double copy_gbps = c ? c->gbps : 0;
    std::printf("%-8s %10.2f %12.2f %8.0f%% %14.1f", entry.first.c_str(), copy_gbps, a->gbps,
                copy_gbps > 0 ? 100.0 * a->gbps / copy_gbps : 0.0, a->ms);
    if (t != nullptr) {
      std::printf(" %14.1f %8.2fx\n", t->ms, t->ms / a->ms);
    } else {  // LibTorch has no such optimizer (LAMB)
      std::printf(" %14s %9s\n", "-", "-");
    }
  }
}

}  // namespace bench
}  // namespace ampx
