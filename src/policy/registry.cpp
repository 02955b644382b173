// The process-wide cast-policy registry: set/reset/get, CastPolicyGuard.

#include "ampx/policy.h"

#include "../core/device_check.h"
#include "policy_compat.h"
#include "registry.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <map>
#include <mutex>
#include <utility>

namespace ampx {
namespace detail {
namespace {

struct Registration {
  PolicyEntry entry;
  c10::RegistrationHandleRAII handle;  // dropping it re-activates PyTorch's kernel
};

using Key = std::pair<int, std::string>;  // (device, "ns::name.overload")

struct Registry {
  std::mutex mutex;
  std::map<Key, Registration> registrations;
};

// Leaked on purpose: registrations then never outlive the dispatcher at exit.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

Key key_of(c10::DeviceType device_type, const c10::OperatorName& op) {
  return {static_cast<int>(device_type), op_string(op)};
}

// Caller holds the registry mutex.
void apply_locked(Registry& r, c10::DeviceType device_type, const c10::OperatorName& op,
                  const c10::optional<PolicyEntry>& entry) {
  const Key key = key_of(device_type, op);
  auto it = r.registrations.find(key);
  if (!entry) {
    if (it != r.registrations.end()) r.registrations.erase(it);
    return;
  }
  if (it != r.registrations.end() && it->second.entry == *entry) return;
  [[maybe_unused]] OverrideWarningFilter quiet;
  // Register the new kernel before dropping the old one, so that no call in
  // between meets PyTorch's kernel.
  auto handle = c10::Dispatcher::singleton().registerImpl(
      op, autocast_key(device_type, "set_cast_policy"), make_policy_kernel(*entry, device_type),
      c10::nullopt, nullptr,
      std::string("ampx cast policy ") +
          (entry->fallthrough ? "fallthrough" : to_string(entry->policy)) +
          (entry->wide ? " with wide products" : ""));
  if (it != r.registrations.end()) {
    it->second.entry = *entry;
    // Moving into a handle does not run the old one's deregistration: take
    // it out first, so that it is dropped here (else the old kernel stays in
    // the dispatcher and comes back when the new one is dropped).
    c10::RegistrationHandleRAII old = std::move(it->second.handle);
    it->second.handle = std::move(handle);
  } else {
    r.registrations.emplace(key, Registration{*entry, std::move(handle)});
  }
}

}  // namespace

c10::DispatchKey autocast_key(c10::DeviceType device_type, const char* who) {
  check_autocast_device(device_type, who);
  return at::autocast::get_autocast_dispatch_key_from_device_type(device_type);
}

std::string op_string(const c10::OperatorName& name) {
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

std::vector<c10::OperatorName> resolve_op(const std::string& op, const char* who) {
  const auto sep = op.find("::");
  TORCH_CHECK_VALUE(sep != std::string::npos && sep > 0 && sep + 2 < op.size(), who,
                    ": op must be a schema name with namespace, such as \"aten::mm\" or "
                    "\"aten::softmax.int\", got \"",
                    op, "\"");
  auto& dispatcher = c10::Dispatcher::singleton();
  std::vector<c10::OperatorName> out;
  const auto dot = op.find('.', sep + 2);
  if (dot != std::string::npos) {
    c10::OperatorName name{op.substr(0, dot), op.substr(dot + 1)};
    auto handle = dispatcher.findOp(name);
    if (handle && handle->hasSchema()) out.push_back(name);
  } else {
    for (const auto& name : dispatcher.getAllOpNames()) {
      if (name.name != op) continue;
      auto handle = dispatcher.findOp(name);
      if (handle && handle->hasSchema() && !writes_an_argument(handle->schema())) {
        out.push_back(name);
      }
    }
  }
  TORCH_CHECK_VALUE(!out.empty(), who, ": no operator \"", op,
                    "\" is registered (custom ops must be defined before their policy is set)");
  return out;
}

bool writes_argument(const c10::Argument& arg) {
  return arg.alias_info() != nullptr && arg.alias_info()->isWrite();
}

bool writes_an_argument(const c10::FunctionSchema& schema) {
  for (const auto& arg : schema.arguments()) {
    if (writes_argument(arg)) return true;
  }
  return false;
}

std::unique_ptr<PolicySnapshot> set_policies(
    c10::DeviceType device_type,
    const std::vector<std::pair<c10::OperatorName, c10::optional<PolicyEntry>>>& changes) {
  autocast_key(device_type, "set_cast_policy");
  auto snapshot = std::make_unique<PolicySnapshot>();
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  try {
    for (const auto& change : changes) {
      auto it = r.registrations.find(key_of(device_type, change.first));
      snapshot->items.emplace_back(device_type, change.first,
                                   it == r.registrations.end()
                                       ? c10::nullopt
                                       : c10::optional<PolicyEntry>(it->second.entry));
      apply_locked(r, device_type, change.first, change.second);
    }
  } catch (...) {  // all or nothing
    for (auto it = snapshot->items.rbegin(); it != snapshot->items.rend(); ++it) {
      apply_locked(r, std::get<0>(*it), std::get<1>(*it), std::get<2>(*it));
    }
    throw;
  }
  return snapshot;
}

void restore_policies(PolicySnapshot& snapshot) noexcept {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto it = snapshot.items.rbegin(); it != snapshot.items.rend(); ++it) {
    try {
      apply_locked(r, std::get<0>(*it), std::get<1>(*it), std::get<2>(*it));
    } catch (const std::exception& e) {
      TORCH_WARN("ampx: could not restore the cast policy of ", op_string(std::get<1>(*it)), ": ",
                 e.what());
    }
  }
  snapshot.items.clear();
}

c10::optional<PolicyEntry> get_policy(c10::DeviceType device_type, const c10::OperatorName& op) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.registrations.find(key_of(device_type, op));
  if (it == r.registrations.end()) return c10::nullopt;
  return it->second.entry;
}

std::vector<c10::OperatorName> ops_with_policy(c10::DeviceType device_type) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<c10::OperatorName> out;
  for (const auto& kv : r.registrations) {
    if (kv.first.first != static_cast<int>(device_type)) continue;
    const auto& s = kv.first.second;
    const auto dot = s.find('.', s.find("::") + 2);
    out.push_back(dot == std::string::npos
                      ? c10::OperatorName{s, ""}
                      : c10::OperatorName{s.substr(0, dot), s.substr(dot + 1)});
  }
  return out;
}

}  // namespace detail

namespace {
std::vector<std::pair<c10::OperatorName, c10::optional<detail::PolicyEntry>>> changes_for(
    const std::vector<std::pair<std::string, CastPolicy>>& policies, const char* who) {
  std::vector<std::pair<c10::OperatorName, c10::optional<detail::PolicyEntry>>> changes;
  for (const auto& p : policies) {
    for (auto& name : detail::resolve_op(p.first, who)) {
      changes.emplace_back(std::move(name), detail::PolicyEntry{p.second, false});
    }
  }
  return changes;
}
}  // namespace

const char* to_string(CastPolicy policy) {
  switch (policy) {
    case CastPolicy::kLowerPrecision:
      return "kLowerPrecision";
    case CastPolicy::kFp32:
      return "kFp32";
    case CastPolicy::kPromote:
      return "kPromote";
    case CastPolicy::kPassthrough:
      return "kPassthrough";
    case CastPolicy::kFp32OutputsAsInput:
      return "kFp32OutputsAsInput";
  }
  return "unknown";
}

void set_cast_policy(c10::DeviceType device_type, const std::string& op, CastPolicy policy) {
  detail::autocast_key(device_type, "set_cast_policy");
  detail::set_policies(device_type, changes_for({{op, policy}}, "set_cast_policy"));
}

void reset_cast_policy(c10::DeviceType device_type, const std::string& op) {
  detail::autocast_key(device_type, "reset_cast_policy");
  std::vector<std::pair<c10::OperatorName, c10::optional<detail::PolicyEntry>>> changes;
  for (auto& name : detail::resolve_op(op, "reset_cast_policy")) {
    changes.emplace_back(std::move(name), c10::nullopt);
  }
  detail::set_policies(device_type, changes);
}

void reset_all_cast_policies(c10::DeviceType device_type) {
  detail::autocast_key(device_type, "reset_all_cast_policies");
  std::vector<std::pair<c10::OperatorName, c10::optional<detail::PolicyEntry>>> changes;
  for (auto& name : detail::ops_with_policy(device_type)) {
    const auto entry = detail::get_policy(device_type, name);
    if (entry && entry->inherited) continue;  // a WideProductsGuard's route, no policy
    changes.emplace_back(std::move(name), c10::nullopt);
  }
  detail::set_policies(device_type, changes);
}

c10::optional<CastPolicy> get_cast_policy(c10::DeviceType device_type, const std::string& op) {
  detail::autocast_key(device_type, "get_cast_policy");
  c10::optional<CastPolicy> common;
  bool first = true;
  for (const auto& name : detail::resolve_op(op, "get_cast_policy")) {
    auto entry = detail::get_policy(device_type, name);
    c10::optional<CastPolicy> p;
    if (entry && !entry->inherited) p = entry->fallthrough ? CastPolicy::kPassthrough : entry->policy;
    if (first) {
      common = p;
      first = false;
    } else if (common != p) {
      return c10::nullopt;
    }
  }
  return common;
}

std::vector<std::pair<std::string, CastPolicy>> get_all_cast_policies(c10::DeviceType device_type) {
  detail::autocast_key(device_type, "get_all_cast_policies");
  std::vector<std::pair<std::string, CastPolicy>> out;
  for (const auto& name : detail::ops_with_policy(device_type)) {
    auto entry = detail::get_policy(device_type, name);
    if (entry && !entry->inherited) {
      out.emplace_back(detail::op_string(name),
                       entry->fallthrough ? CastPolicy::kPassthrough : entry->policy);
    }
  }
  return out;
}

std::vector<std::string> cast_policy_overloads(const std::string& op) {
  std::vector<std::string> out;
  for (const auto& name : detail::resolve_op(op, "cast_policy_overloads")) {
    out.push_back(detail::op_string(name));
  }
  return out;
}

CastPolicyGuard::CastPolicyGuard(c10::DeviceType device_type,
                                 std::initializer_list<std::pair<std::string, CastPolicy>> policies)
    : CastPolicyGuard(device_type, std::vector<std::pair<std::string, CastPolicy>>(policies)) {}

CastPolicyGuard::CastPolicyGuard(c10::DeviceType device_type,
                                 const std::vector<std::pair<std::string, CastPolicy>>& policies) {
  detail::autocast_key(device_type, "CastPolicyGuard");
  saved_ = detail::set_policies(device_type, changes_for(policies, "CastPolicyGuard"));
}

CastPolicyGuard::~CastPolicyGuard() {
  detail::restore_policies(*saved_);
}

}  // namespace ampx
