// Where the bytes at the peak came from (ampx/memory.h's MemoryOrigin): a
// global RecordFunction callback keeps each thread's outermost op (or
// autograd node) and CpuMemoryPhaseGuard its phase; the tracking allocator
// asks for the pair's id at each allocation and keeps it in the block's
// header. Names and origins are interned for the process's life (a run has a
// few hundred), and their live bytes kept under one mutex: recording is a
// diagnostic, slower than tracking alone. Each start_cpu_memory_origins()
// interns its origins anew: blocks of an earlier recording still live count
// as not recorded, as blocks from before any recording do.

#include "memory_origins.h"

#include "ampx/memory.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ampx {
namespace detail {
namespace {

/// Interned names (phases and ops) and origins (a phase and an op), and
/// each origin's live bytes and blocks, now and at the peak.
struct Record {
  std::mutex mutex;
  std::deque<std::string> names{""};  // id 0: the empty name
  std::unordered_map<std::string, uint32_t> name_ids{{"", 0u}};
  std::vector<std::pair<uint32_t, uint32_t>> origins{{0u, 0u}};  // id 0: not recorded
  std::unordered_map<uint64_t, uint32_t> origin_ids;             // this recording's
  uint32_t first_origin = 1;                                     // this recording's first id
  std::vector<int64_t> bytes{0}, blocks{0};
  std::vector<int64_t> peak_bytes{0}, peak_blocks{0};
  int64_t peak_allocated = 0, peak_live_blocks = 0;
};

Record& record() {
  static auto* r = new Record();  // never destroyed: blocks are freed at exit too
  return *r;
}

std::atomic<bool> g_recording{false};
std::mutex g_callback_mutex;
at::CallbackHandle g_callback = 0;

// This thread's phase and outermost op, as name ids; how deep in ops it is.
// Trivially destructible: the allocator may run while threads end.
thread_local uint32_t t_phase = 0;
thread_local uint32_t t_op = 0;
thread_local int t_depth = 0;

uint32_t intern_name(const std::string& name) {
  auto& r = record();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto [it, added] = r.name_ids.emplace(name, static_cast<uint32_t>(r.names.size()));
  if (added) r.names.push_back(name);
  return it->second;
}

/// An op entered on this thread: whether it was the outermost, so that its
/// end (on whichever thread) leaves no op behind.
struct Entered : at::ObserverContext {
  explicit Entered(bool outermost) : outermost(outermost) {}
  bool outermost;
};

/// An op's name, a node's without the prefix of the autograd engine's
/// scope around it ("autograd::engine::evaluate_function: MulBackward0").
std::string op_name(const char* name) {
  static constexpr char kEngine[] = "autograd::engine::evaluate_function: ";
  constexpr size_t kEngineLength = sizeof(kEngine) - 1;
  return std::strncmp(name, kEngine, kEngineLength) == 0 ? name + kEngineLength : name;
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  const bool outermost = t_depth++ == 0;
  if (outermost) t_op = intern_name(op_name(fn.name()));
  return std::make_unique<Entered>(outermost);
}

void on_op_end(const at::RecordFunction&, at::ObserverContext* context) {
  const auto* entered = static_cast<const Entered*>(context);
  if (entered == nullptr) return;
  if (entered->outermost) {
    t_op = 0;
    t_depth = 0;
  } else if (t_depth > 0) {
    --t_depth;
  }
}

/// The peak is what is live now (the caller holds r.mutex).
void keep_peak(Record& r, int64_t allocated, int64_t live_blocks) {
  r.peak_bytes = r.bytes;
  r.peak_blocks = r.blocks;
  r.peak_allocated = allocated;
  r.peak_live_blocks = live_blocks;
}

}  // namespace

bool recording_memory_origins() {
  return g_recording.load(std::memory_order_relaxed);
}

uint32_t note_origin_allocation(int64_t size, int64_t allocated, int64_t live_blocks) {
  auto& r = record();
  std::lock_guard<std::mutex> lock(r.mutex);
  const uint64_t key = (static_cast<uint64_t>(t_phase) << 32) | t_op;
  const auto [it, added] = r.origin_ids.emplace(key, static_cast<uint32_t>(r.origins.size()));
  if (added) {
    r.origins.emplace_back(t_phase, t_op);
    r.bytes.push_back(0);
    r.blocks.push_back(0);
  }
  const uint32_t id = it->second;
  r.bytes[id] += size;
  r.blocks[id] += 1;
  if (allocated > r.peak_allocated) keep_peak(r, allocated, live_blocks);
  return id;
}

void note_origin_free(uint32_t origin, int64_t size) {
  auto& r = record();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.bytes[origin] -= size;
  r.blocks[origin] -= 1;
}

void note_origin_peak_reset(int64_t allocated, int64_t live_blocks) {
  if (!recording_memory_origins()) return;  // the recorded peak stays readable after stop
  auto& r = record();
  std::lock_guard<std::mutex> lock(r.mutex);
  keep_peak(r, allocated, live_blocks);
}

}  // namespace detail

void start_cpu_memory_origins() {
  enable_cpu_memory_tracking();
  std::lock_guard<std::mutex> lock(detail::g_callback_mutex);
  if (detail::g_callback == 0) {
    detail::g_callback = at::addGlobalCallback(
        at::RecordFunctionCallback(&detail::on_op_start, &detail::on_op_end)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  }
  auto& r = detail::record();
  {
    std::lock_guard<std::mutex> record_lock(r.mutex);
    r.origin_ids.clear();
    r.first_origin = static_cast<uint32_t>(r.origins.size());
    detail::keep_peak(r, cpu_memory_stats().allocated_bytes, detail::live_cpu_blocks());
  }
  detail::g_recording.store(true);
}

void stop_cpu_memory_origins() {
  detail::g_recording.store(false);
  std::lock_guard<std::mutex> lock(detail::g_callback_mutex);
  if (detail::g_callback != 0) at::removeCallback(detail::g_callback);
  detail::g_callback = 0;
}

std::vector<MemoryOrigin> peak_cpu_memory_origins() {
  auto& r = detail::record();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<MemoryOrigin> out;
  int64_t recorded = 0, recorded_blocks = 0;
  for (size_t id = r.first_origin; id < r.peak_bytes.size(); ++id) {
    if (r.peak_blocks[id] == 0) continue;
    const auto [phase, op] = r.origins[id];
    out.push_back({r.names[phase], r.names[op], r.peak_bytes[id], r.peak_blocks[id]});
    recorded += r.peak_bytes[id];
    recorded_blocks += r.peak_blocks[id];
  }
  if (r.peak_allocated > recorded) {
    out.push_back({kNotRecordedPhase, "", r.peak_allocated - recorded,
                   std::max<int64_t>(r.peak_live_blocks - recorded_blocks, 0)});
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const MemoryOrigin& a, const MemoryOrigin& b) { return a.bytes > b.bytes; });
  return out;
}

CpuMemoryPhaseGuard::CpuMemoryPhaseGuard(const std::string& phase) : previous_(detail::t_phase) {
  detail::t_phase = detail::intern_name(phase);
}

CpuMemoryPhaseGuard::~CpuMemoryPhaseGuard() {
  detail::t_phase = previous_;
}

}  // namespace ampx
