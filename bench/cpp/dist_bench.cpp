// Data parallelism on this machine, over loopback with c10d/Gloo, in one run:
//
//   build/host/bench/ampx_dist_bench [--world 2] [--steps 12] [--precision O2|O1|fp32]
//                                    [--bucket-mib 25] [--json FILE]
//
// 1. Collective bandwidth between `world` processes: all-reduce (sum) of
//    fp32 and of 16-bit gradients (bf16 where Gloo sums it, LibTorch 2.x;
//    fp16 on 1.13), reduce-scatter and all-gather, 1 to 64 MiB. Reported as
//    algorithm bandwidth (buffer bytes / time) and bus bandwidth (what each
//    rank sends: 2(n-1)/n of the buffer for an all-reduce, (n-1)/n for the
//    other two), which is what compares across world sizes.
// 2. The `gpt` workload's training step (4 layers, d 256, global batch 32 x
//    128, ampx AdamW) with 1 process using every core and with `world`
//    processes sharing them, DistributedDataParallel with 25 MiB buckets
//    (--bucket-mib) after a first one of 1 MiB.
// 3. How much of the gradient communication backward hides: per rank, the
//    step with DDP (t_sync), the same step under no_sync (t_local, no
//    communication) and the bucket all-reduces alone (t_comm);
//    hidden = 1 - (t_sync - t_local) / t_comm.
//
// Ranks are this program re-executed with torchrun's variables on a free port.

#include "models.h"

#include <ampx/ampx.h>
#include <ampx/dist.h>

#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

struct Args {
  int world = 2;
  int steps = 12;
  std::string precision = "O2";
  int64_t bucket_mib = 25;
  std::string json_path;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

template <class F>
double time_ms(F&& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

/// The median ms of `steps` calls of f after 2 untimed ones, each call after a barrier of pg (if
/// any).
template <class F>
double median_ms(int steps, const ampx::dist::ProcessGroup* pg, F&& f) {
  std::vector<double> ms;
  for (int i = 0; i < steps + 2; ++i) {
    if (pg) pg->barrier();
    const double t = time_ms(f);
    if (i >= 2) ms.push_back(t);
  }
  return median(ms);
}

bool gloo_sums_bf16() {
  return std::string(ampx::torch_version()).rfind("1.", 0) != 0;
}

// --- rank side --------------------------------------------------------------

json collectives(const ampx::dist::ProcessGroup& pg) {
  const double n = static_cast<double>(pg.world_size());
  const auto half = gloo_sums_bf16() ? torch::kBFloat16 : torch::kHalf;
  json rows = json::array();
  for (const int64_t mib : {1, 4, 16, 64}) {
    for (const auto dtype : {torch::kFloat, half}) {
      const int64_t bytes = mib << 20,
                    numel = bytes / static_cast<int64_t>(c10::elementSize(dtype));
      auto buffer = torch::ones({numel}, dtype);
      auto shard = torch::empty({numel / pg.world_size()}, dtype);
      auto chunk = torch::ones({numel / pg.world_size()}, dtype);
      auto gathered = torch::empty({chunk.numel() * pg.world_size()}, dtype);
      struct Op {
        const char* name;
        double bus_factor;
        std::function<void()> run;
      };
      const std::vector<Op> ops = {
          {"all_reduce", 2 * (n - 1) / n, [&] { pg.all_reduce_sum(buffer); }},
          {"reduce_scatter", (n - 1) / n, [&] { pg.reduce_scatter_sum(shard, buffer); }},
          {"all_gather", (n - 1) / n, [&] { pg.all_gather(gathered, chunk); }},
      };
      for (const auto& op : ops) {
        std::vector<double> ms;
        const int reps = mib >= 16 ? 5 : 12;
        for (int i = 0; i < reps + 2; ++i) {
          pg.barrier();
          const double t = time_ms(op.run);
          if (i >= 2) ms.push_back(t);
        }
        const double t = median(ms);
        rows.push_back({{"op", op.name},
                        {"dtype", c10::toString(dtype)},
                        {"mib", mib},
                        {"ms", t},
                        {"algbw_gbps", bytes / t / 1e6},
                        {"busbw_gbps", bytes * op.bus_factor / t / 1e6}});
        buffer.fill_(1);  // keep the sums finite
      }
    }
  }
  return rows;
}

/// A buffer per bucket of ddp, as large as its parameters, in the dtype DDP sends it in.
std::vector<torch::Tensor> bucket_buffers(const ampx::dist::DistributedDataParallel& ddp,
                                          const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> buckets;
  for (const auto& b : ddp.bucket_layout()) {
    int64_t numel = 0;
    for (const auto i : b) numel += params[i].numel();
    auto dtype = params[b[0]].scalar_type();
    if (dtype == torch::kBFloat16 && !gloo_sums_bf16()) dtype = torch::kFloat;  // DDP widens
    buckets.push_back(torch::ones({numel}, dtype));
  }
  return buckets;
}

json gpt_steps(const Args& args, const c10::optional<ampx::dist::ProcessGroup>& pg) {
  const int64_t world = pg ? pg->world_size() : 1, rank = pg ? pg->rank() : 0;
  ampx::train::GPTConfig cfg;  // 4 layers, d 256, 4 heads, block 128: the main job
  const int64_t global_batch = 32, batch = global_batch / world;
  torch::manual_seed(0);
  ampx::train::GPT gpt(cfg);
  ampx::optim::AdamW opt(gpt->parameters(), ampx::optim::AdamWOptions(3e-4));
  const auto level = args.precision == "O1"   ? ampx::OptLevel::O1
                     : args.precision == "O2" ? ampx::OptLevel::O2
                                              : ampx::OptLevel::O0;
  auto amp = ampx::initialize(gpt.ptr(), {&opt},
                              ampx::AmpOptions(level).cast_model_outputs(torch::kFloat));
  std::unique_ptr<ampx::dist::DistributedDataParallel> ddp;
  if (pg) {
    ddp = std::make_unique<ampx::dist::DistributedDataParallel>(
        gpt.ptr(), *pg,
        ampx::dist::DistributedDataParallelOptions().bucket_cap_bytes(args.bucket_mib << 20));
  }
  torch::manual_seed(1 + rank);
  const auto tokens = torch::randint(cfg.vocab, {batch, cfg.block + 1});
  const auto x = tokens.slice(1, 0, cfg.block), y = tokens.slice(1, 1);

  auto step = [&](bool communicate) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      auto forward = amp.forward_guard();
      auto logits = amp.cast_output(gpt->forward(x));
      loss = torch::nn::functional::cross_entropy(logits.view({-1, cfg.vocab}), y.reshape({-1}));
    }
    if (ddp && !communicate) {
      auto local = ddp->no_sync();
      amp.scaler().scale(loss).backward();
    } else {
      amp.scaler().scale(loss).backward();
      if (ddp) ddp->synchronize();
    }
    amp.scaler().step(opt);
    amp.scaler().update();
  };
  const double t_sync = median_ms(args.steps, pg ? &*pg : nullptr, [&] { step(true); });
  json out = {{"world", world},
              {"threads_per_rank", at::get_num_threads()},
              {"global_batch", global_batch},
              {"block", cfg.block},
              {"precision", args.precision},
              {"step_ms", t_sync},
              {"tokens_per_s", global_batch * cfg.block / t_sync * 1e3}};
  if (!ddp) return out;
  const double t_local = median_ms(args.steps, &*pg, [&] { step(false); });
  // The buckets' all-reduces alone, in the dtypes DDP sends them in.
  const int64_t bytes_per_step = ddp->bytes_communicated() / (args.steps + 2);  // synced steps
  auto buckets = bucket_buffers(*ddp, gpt->parameters());
  const double t_comm = median_ms(args.steps, &*pg, [&] {
    for (auto& b : buckets) pg->all_reduce_sum(b);
  });
  const double exposed = std::max(0.0, t_sync - t_local);
  out.update({{"local_step_ms", t_local},
              {"comm_ms", t_comm},
              {"exposed_comm_ms", exposed},
              {"hidden_fraction", std::clamp(1.0 - exposed / t_comm, 0.0, 1.0)},
              {"bytes_per_step", bytes_per_step},
              {"buckets", static_cast<int64_t>(buckets.size())}});
  return out;
}

int rank_main(const Args& args, const std::string& role, const std::string& out_path) {
  json result;
  if (role == "gpt1") {
    at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
    result = gpt_steps(args, c10::nullopt);
  } else {
    auto pg = ampx::dist::init_process_group();
    const int threads = std::max<int>(1, static_cast<int>(std::thread::hardware_concurrency()) /
                                             static_cast<int>(pg.world_size()));
    at::set_num_threads(threads);
    result = role == "collectives" ? json(collectives(pg)) : gpt_steps(args, pg);
    if (pg.rank() != 0) return 0;
  }
  std::ofstream(out_path) << result.dump();
  return 0;
}

// --- parent side -------------------------------------------------------------

json spawn(const char* self, const Args& args, const std::string& role, int world) {
  const std::string out = "/tmp/ampx-dist-bench-" + std::to_string(::getpid()) + "-" + role;
  const std::string port = std::to_string(ampx::dist::free_loopback_port());
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("AMPX_DIST_BENCH_ROLE", role.c_str(), 1);
      ::setenv("AMPX_DIST_BENCH_OUT", out.c_str(), 1);
      if (role != "gpt1") {
        ::setenv("RANK", std::to_string(r).c_str(), 1);
        ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
        ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
        ::setenv("MASTER_ADDR", "127.0.0.1", 1);
        ::setenv("MASTER_PORT", port.c_str(), 1);
      }
      const std::string w = std::to_string(args.world), s = std::to_string(args.steps),
                        b = std::to_string(args.bucket_mib);
      ::execl(self, self, "--world", w.c_str(), "--steps", s.c_str(), "--precision",
              args.precision.c_str(), "--bucket-mib", b.c_str(), nullptr);
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (const pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  if (!ok) throw std::runtime_error("ampx_dist_bench: a " + role + " rank failed");
  json result;
  std::ifstream(out) >> result;
  std::remove(out.c_str());
  return result;
}

/// Reads the flags into `args`; returns 0, or 2 after saying what is wrong.
int parse_args(int argc, char** argv, Args& args) {
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (v == nullptr) {
      std::fprintf(stderr, "ampx_dist_bench: %s needs a value\n", k.c_str());
      return 2;
    }
    if (k == "--world") {
      args.world = std::atoi(v);
    } else if (k == "--steps") {
      args.steps = std::atoi(v);
    } else if (k == "--precision") {
      args.precision = v;
    } else if (k == "--bucket-mib") {
      args.bucket_mib = std::atoll(v);
    } else if (k == "--json") {
      args.json_path = v;
    } else {
      std::fprintf(stderr, "ampx_dist_bench: unknown flag %s\n", k.c_str());
      return 2;
    }
    ++i;
  }
  if (args.world < 2 || args.steps < 1 || args.bucket_mib < 1 ||
      (args.precision != "O1" && args.precision != "O2" && args.precision != "fp32")) {
    std::fprintf(
        stderr,
        "ampx_dist_bench: --world >= 2, --steps >= 1, --bucket-mib >= 1, --precision O1|O2|fp32\n");
    return 2;
  }
  return 0;
}

/// Prints the tables of the three runs: collectives, gpt steps, and DDP's hidden communication.
void print_results(const Args& args, const json& coll, const json& one, const json& many) {
  std::printf("LibTorch %s, %u cores, %d processes on loopback (Gloo)\n\n", ampx::torch_version(),
              std::thread::hardware_concurrency(), args.world);
  std::printf("| collective | dtype | MiB | ms | algbw GB/s | busbw GB/s |\n");
  std::printf("| --- | --- | ---: | ---: | ---: | ---: |\n");
  for (const auto& r : coll) {
    std::printf("| %s | %s | %lld | %.2f | %.2f | %.2f |\n", r["op"].get<std::string>().c_str(),
                r["dtype"].get<std::string>().c_str(),
                static_cast<long long>(r["mib"].get<int64_t>()), r["ms"].get<double>(),
                r["algbw_gbps"].get<double>(), r["busbw_gbps"].get<double>());
  }
  std::printf("\n| gpt %s | threads/rank | step ms | tokens/s | vs 1 process |\n",
              args.precision.c_str());
  std::printf("| --- | ---: | ---: | ---: | ---: |\n");
  for (const auto* r : {&one, &many}) {
    std::printf("| %lld process(es) | %lld | %.1f | %.0f | %.2fx |\n",
                static_cast<long long>((*r)["world"].get<int64_t>()),
                static_cast<long long>((*r)["threads_per_rank"].get<int64_t>()),
                (*r)["step_ms"].get<double>(), (*r)["tokens_per_s"].get<double>(),
                (*r)["tokens_per_s"].get<double>() / one["tokens_per_s"].get<double>());
  }
  std::printf(
      "\nDDP, %d processes: step %.1f ms with communication, %.1f ms without (no_sync); the "
      "%lld bucket all-reduce(s) of %.1f MiB alone take %.1f ms: %.1f ms exposed, %.0f%% "
      "hidden behind backward\n",
      args.world, many["step_ms"].get<double>(), many["local_step_ms"].get<double>(),
      static_cast<long long>(many["buckets"].get<int64_t>()),
      many["bytes_per_step"].get<double>() / (1 << 20), many["comm_ms"].get<double>(),
      many["exposed_comm_ms"].get<double>(), 100 * many["hidden_fraction"].get<double>());
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (const int code = parse_args(argc, argv, args)) return code;
  if (!ampx::dist::is_available()) {
    std::fprintf(stderr, "ampx_dist_bench: this ampx was built without c10d/Gloo\n");
    return 1;
  }
  try {
    if (const char* role = std::getenv("AMPX_DIST_BENCH_ROLE")) {
      return rank_main(args, role, std::getenv("AMPX_DIST_BENCH_OUT"));
    }
    const json coll = spawn(argv[0], args, "collectives", args.world);
    const json one = spawn(argv[0], args, "gpt1", 1);
    const json many = spawn(argv[0], args, "gpt", args.world);

    print_results(args, coll, one, many);
    if (!args.json_path.empty()) {
      const json all = {{"torch_version", ampx::torch_version()},
                        {"cores", std::thread::hardware_concurrency()},
                        {"world", args.world},
                        {"bucket_mib", args.bucket_mib},
                        {"collectives", coll},
                        {"gpt_1_process", one},
                        {"gpt_data_parallel", many}};
      std::ofstream(args.json_path) << all.dump(2) << "\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
