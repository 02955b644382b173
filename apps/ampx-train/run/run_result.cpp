#include "run_result.h"

#include <algorithm>
#include <cmath>

namespace ampx::train {
namespace {

/// Every field that travels, once: visit(name, member) in to_json's order.
template <typename Result, typename Visit>
void for_each_field(Result& r, Visit&& visit) {
  visit("mode", r.mode);
  visit("dtype", r.dtype);
  visit("blas", r.blas);
  visit("cpu_products", r.cpu_products);
  visit("steps", r.steps);
  visit("timed_steps", r.timed_steps);
  visit("items_per_s", r.items_per_s);
  visit("median_step_ms", r.median_step_ms);
  visit("peak_bytes", r.peak_bytes);
  visit("rank_peak_bytes", r.rank_peak_bytes);
  visit("optimizer_bytes", r.optimizer_bytes);
  visit("params", r.params);
  visit("weight_bytes", r.weight_bytes);
  visit("gathered_bytes", r.gathered_bytes);
  visit("memory_origins", r.memory_origins);
  visit("train_loss", r.train_loss);
  visit("eval", r.eval);
  visit("skipped", r.skipped);
  visit("final_scale", r.final_scale);
  visit("losses", r.losses);
  visit("evals", r.evals);
  visit("metrics_path", r.metrics_path);
  visit("fp8_trace_path", r.fp8_trace_path);
  visit("checkpoint_path", r.checkpoint_path);
  visit("weights_path", r.weights_path);
  visit("plan_watch", r.plan_watch);
  visit("watched_plan_path", r.watched_plan_path);
  visit("tail_start", r.tail_start);
}

// Fields results written before them do not have.
bool came_later(const std::string& name) {
  return name == "fp8_trace_path" || name == "plan_watch" || name == "watched_plan_path" ||
         name == "cpu_products" || name == "tail_start" || name == "rank_peak_bytes" ||
         name == "optimizer_bytes" || name == "params" || name == "weight_bytes" ||
         name == "gathered_bytes" || name == "memory_origins";
}

template <typename T>
nlohmann::json json_of(const T& v) {
  return v;  // NaN becomes null
}
nlohmann::json json_of(const EvalResult& e) {
  return {e.loss, e.metric};
}
nlohmann::json json_of(const std::vector<ampx::MemoryOrigin>& origins) {
  return memory_origins_json(origins);
}
nlohmann::json json_of(const std::vector<std::pair<int64_t, EvalResult>>& evals) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [step, e] : evals) out.push_back({step, e.loss, e.metric});
  return out;
}

// JSON has no NaN (nlohmann writes null): a diverged run's losses come back as NaN.
void read(const nlohmann::json& j, double& v) {
  v = j.is_null() ? NAN : j.get<double>();
}
void read(const nlohmann::json& j, int64_t& v) {
  v = j.get<int64_t>();
}
void read(const nlohmann::json& j, std::string& v) {
  v = j.get<std::string>();
}
void read(const nlohmann::json& j, EvalResult& e) {
  read(j.at(0), e.loss);
  read(j.at(1), e.metric);
}
void read(const nlohmann::json& j, std::vector<std::string>& v) {
  for (const auto& x : j) read(x, v.emplace_back());
}
void read(const nlohmann::json& j, std::vector<double>& v) {
  for (const auto& x : j) read(x, v.emplace_back());
}
void read(const nlohmann::json& j, std::vector<int64_t>& v) {
  for (const auto& x : j) read(x, v.emplace_back());
}
void read(const nlohmann::json& j, std::vector<ampx::MemoryOrigin>& origins) {
  for (const auto& o : j) {
    auto& origin = origins.emplace_back();
    read(o.at("phase"), origin.phase);
    read(o.at("op"), origin.op);
    read(o.at("bytes"), origin.bytes);
    read(o.at("blocks"), origin.blocks);
  }
}
void read(const nlohmann::json& j, std::vector<std::pair<int64_t, EvalResult>>& evals) {
  for (const auto& e : j) {
    auto& [step, result] = evals.emplace_back();
    read(e.at(0), step);
    read(e.at(1), result.loss);
    read(e.at(2), result.metric);
  }
}

}  // namespace

nlohmann::json memory_origins_json(const std::vector<ampx::MemoryOrigin>& origins) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& o : origins) {
    out.push_back({{"phase", o.phase}, {"op", o.op}, {"bytes", o.bytes}, {"blocks", o.blocks}});
  }
  return out;
}

nlohmann::json to_json(const RunResult& result) {
  nlohmann::json out = nlohmann::json::object();
  for_each_field(result, [&](const char* name, const auto& v) { out[name] = json_of(v); });
  return out;
}

RunResult run_result_from_json(const nlohmann::json& json) {
  RunResult r;
  for_each_field(r, [&](const char* name, auto& v) {
    if (came_later(name) && !json.contains(name)) return;
    read(json.at(name), v);
  });
  return r;
}

// GCC 14 reports the destructor of summarize_timing's std::vector<double>
// as freeing a non-heap pointer: a false positive inside libstdc++ (GCC 12
// and 16 do not report it).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 14
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wfree-nonheap-object"
#define AMPX_RUN_RESULT_GCC14_PUSHED
#endif

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

/// Throughput over the steps after warm-up (the first steps pay for lazy
/// initialisation in oneDNN, the allocator and the optimizer's state).
void summarize_timing(const Workload& workload, const std::vector<double>& step_ms,
                      RunResult& result) {
  const size_t warm = std::min<size_t>(10, std::max<size_t>(1, step_ms.size() / 10));
  if (step_ms.size() <= warm) return;
  std::vector<double> timed(step_ms.begin() + static_cast<std::ptrdiff_t>(warm), step_ms.end());
  double sum = 0;
  for (double t : timed) sum += t;
  result.timed_steps = static_cast<int64_t>(timed.size());
  result.items_per_s = workload.items_per_step() * 1000.0 * timed.size() / sum;
  result.median_step_ms = median(timed);
}

#ifdef AMPX_RUN_RESULT_GCC14_PUSHED
#pragma GCC diagnostic pop
#undef AMPX_RUN_RESULT_GCC14_PUSHED
#endif

}  // namespace ampx::train
