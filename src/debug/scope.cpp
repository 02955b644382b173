#include "ampx/debug/scope.h"

#include "scope_internal.h"

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ampx {
namespace debug {
namespace {

thread_local std::vector<std::string> t_scopes;
std::atomic<int> g_recording{0};

struct ModuleEntry {
  std::weak_ptr<const torch::nn::Module> owner;
  bool owned = true;  // false for a root not held by a shared_ptr
  std::string path;
};
struct ParameterEntry {
  c10::weak_intrusive_ptr<c10::TensorImpl> owner;
  detail::ParameterName name;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, ModuleEntry> modules;
  std::unordered_map<const c10::TensorImpl*, ParameterEntry> parameters;
  // The same entries by storage, for views of parameters (weight.t() in addmm).
  std::unordered_map<const c10::StorageImpl*, const c10::TensorImpl*> by_storage;
  std::atomic<bool> any_parameter{false};
};
Registry& registry() {
  static Registry* r = new Registry();  // outlives every static destructor
  return *r;
}

// Sequence-number runs per forward thread: (first sequence number, scope).
// A node created by a forward op belongs to the last run that began at or
// before its sequence number. Bounded: the oldest half goes past kMaxRuns.
constexpr size_t kMaxRuns = 1 << 16;
struct SequenceLog {
  std::mutex mutex;
  std::unordered_map<uint64_t, std::deque<std::pair<uint64_t, std::string>>> runs;
};
SequenceLog& sequence_log() {
  static SequenceLog* log = new SequenceLog();
  return *log;
}

void log_scope_change() {
  if (g_recording.load(std::memory_order_relaxed) == 0) return;
  auto& log = sequence_log();
  const uint64_t thread = at::RecordFunction::currentThreadId();
  const uint64_t seq = at::sequence_number::peek();
  std::lock_guard<std::mutex> lock(log.mutex);
  auto& runs = log.runs[thread];
  const std::string& scope = detail::innermost_scope();
  if (!runs.empty() && runs.back().first == seq) {
    runs.back().second = scope;  // no node was created in the previous run
  } else {
    runs.emplace_back(seq, scope);
  }
  if (runs.size() > kMaxRuns) runs.erase(runs.begin(), runs.begin() + kMaxRuns / 2);
}

}  // namespace

namespace detail {

void push_scope(std::string name) {
  t_scopes.push_back(std::move(name));
  log_scope_change();
}

void pop_scope() {
  if (!t_scopes.empty()) t_scopes.pop_back();
  log_scope_change();
}

const std::string& innermost_scope() {
  static const std::string kNone;
  return t_scopes.empty() ? kNone : t_scopes.back();
}

void set_recording(bool on) {
  if (on) {
    g_recording.fetch_add(1);
    log_scope_change();  // scopes already open when recording starts
  } else {
    if (g_recording.fetch_sub(1) == 1) {
      auto& log = sequence_log();
      std::lock_guard<std::mutex> lock(log.mutex);
      log.runs.clear();
    }
  }
}

std::string scope_of_sequence_nr(uint64_t forward_thread, int64_t sequence_nr) {
  if (sequence_nr < 0) return "";
  auto& log = sequence_log();
  std::lock_guard<std::mutex> lock(log.mutex);
  auto it = log.runs.find(forward_thread);
  if (it == log.runs.end()) return "";
  const auto& runs = it->second;
  const auto seq = static_cast<uint64_t>(sequence_nr);
  auto after = std::upper_bound(runs.begin(), runs.end(), seq,
                                [](uint64_t s, const auto& run) { return s < run.first; });
  if (after == runs.begin()) return "";
  return std::prev(after)->second;
}

bool any_parameter_named() {
  return registry().any_parameter.load(std::memory_order_relaxed);
}

bool parameter_name(const c10::TensorImpl* impl, ParameterName* out) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.parameters.find(impl);
  if (it == r.parameters.end() && impl->has_storage()) {
    auto s = r.by_storage.find(impl->storage().unsafeGetStorageImpl());
    if (s != r.by_storage.end()) it = r.parameters.find(s->second);
  }
  if (it == r.parameters.end() || it->second.owner.expired()) return false;
  *out = it->second.name;
  return true;
}

}  // namespace detail

void name_modules(const torch::nn::Module& root, const std::string& prefix) {
  std::vector<std::pair<std::string, std::shared_ptr<const torch::nn::Module>>> modules;
  std::shared_ptr<const torch::nn::Module> owned_root;
  try {
    owned_root = root.shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    // a root on the stack: named, without an owner to watch
  }
  for (const auto& item : root.named_modules(prefix, /*include_self=*/false)) {
    modules.emplace_back(item.key(), item.value());
  }
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto it = r.modules.begin(); it != r.modules.end();) {
    const bool dead = it->second.owned && it->second.owner.expired();
    it = dead ? r.modules.erase(it) : std::next(it);
  }
  for (auto it = r.parameters.begin(); it != r.parameters.end();) {
    it = it->second.owner.expired() ? r.parameters.erase(it) : std::next(it);
  }
  r.by_storage.clear();
  auto add = [&](const torch::nn::Module& module, std::weak_ptr<const torch::nn::Module> owner,
                 const std::string& path) {
    const bool owned = !owner.expired();
    r.modules[&module] = ModuleEntry{std::move(owner), owned, path};
    for (const auto& p : module.named_parameters(/*recurse=*/false)) {
      const auto& tensor = p.value();
      if (!tensor.defined()) continue;
      const std::string full = path.empty() ? p.key() : path + "." + p.key();
      r.parameters.insert_or_assign(
          tensor.unsafeGetTensorImpl(),
          ParameterEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(tensor.getIntrusivePtr()),
                         {path, full}});
    }
  };
  add(root, owned_root, prefix);
  for (const auto& [path, module] : modules) add(*module, module, path);
  for (const auto& [impl, entry] : r.parameters) {
    if (impl->has_storage()) r.by_storage[impl->storage().unsafeGetStorageImpl()] = impl;
  }
  r.any_parameter.store(!r.parameters.empty());
}

void clear_module_names() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.modules.clear();
  r.parameters.clear();
  r.by_storage.clear();
  r.any_parameter.store(false);
}

std::string module_path(const torch::nn::Module& module) {
  auto& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.modules.find(&module);
    if (it != r.modules.end()) {
      if (!it->second.owned || !it->second.owner.expired()) return it->second.path;
    }
  }
  return module.name();
}

NamedScopeGuard::NamedScopeGuard(std::string name) {
  detail::push_scope(std::move(name));
}
NamedScopeGuard::~NamedScopeGuard() {
  detail::pop_scope();
}

ModuleScopeGuard::ModuleScopeGuard(const torch::nn::Module& module) {
  detail::push_scope(module_path(module));
}
ModuleScopeGuard::~ModuleScopeGuard() {
  detail::pop_scope();
}

std::string current_scope() {
  return detail::innermost_scope();
}

std::string scope_label(const std::string& scope) {
  return scope.empty() ? "(top level)" : scope;
}

}  // namespace debug
}  // namespace ampx
