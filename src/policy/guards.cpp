// KeepNormsFp32Guard and Fp32RegionGuard: whole-op-set policies on top of the
// registry, with autocast on for the thread so that ops meet the key.

#include "ampx/policy.h"

#include "../core/autocast_region.h"
#include "ampx/autocast.h"
#include "ampx/detail/compat.h"
#include "ampx/kernels/cpu_products.h"
#include "registry.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace ampx {
namespace {

const char* const kNormOps[] = {"batch_norm",
                                "_batch_norm_impl_index",
                                "native_batch_norm",
                                "_native_batch_norm_legit",
                                "_native_batch_norm_legit_no_training",
                                "layer_norm",
                                "native_layer_norm",
                                "group_norm",
                                "native_group_norm",
                                "instance_norm"};

using Changes = std::vector<std::pair<c10::OperatorName, c10::optional<detail::PolicyEntry>>>;

bool is_norm(const std::string& name) {
  for (const char* op : kNormOps) {
    if (name.size() == std::strlen(op) + 6 && name.compare(6, std::string::npos, op) == 0 &&
        name.compare(0, 6, "aten::") == 0) {
      return true;
    }
  }
  return false;
}

// Operator definitions (and removals) since the process started, counted by a
// dispatcher listener: the scan below is redone when the count moves.
std::atomic<uint64_t> g_op_definitions{0};

struct DefinitionCounter final : c10::OpRegistrationListener {
  void onOperatorRegistered(const c10::OperatorHandle&) override { ++g_op_definitions; }
  void onOperatorDeregistered(const c10::OperatorHandle&) override { ++g_op_definitions; }
};

// The ops a guard changes on one device: the functional overloads of the
// norm ops (and, on the CPU, of aten::gelu: its float32-math kernel,
// ampx::mixed_gelu), and every other op with a kernel on the Autocast key.
// Scanning the dispatcher's ~2500 ops costs about 0.4 ms, paid once per
// forward pass before this cache (docs/performance-notes.md).
struct OpScan {
  bool valid = false;
  uint64_t definitions = 0;
  std::vector<c10::OperatorName> norm, rest;
  std::unordered_set<std::string> listed;  // op_string of each of them
};

OpScan scan_ops(c10::DispatchKey key, c10::DeviceType device_type) {
  OpScan scan;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (auto& name : dispatcher.getAllOpNames()) {
    auto handle = dispatcher.findOp(name);
    if (!handle || !handle->hasSchema()) continue;
    if (is_norm(name.name) || (device_type == c10::DeviceType::CPU && name.name == "aten::gelu")) {
      if (detail::writes_an_argument(handle->schema())) continue;
      scan.listed.insert(detail::op_string(name));
      scan.norm.push_back(std::move(name));
    } else if (handle->hasKernelForDispatchKey(key)) {
      scan.listed.insert(detail::op_string(name));
      scan.rest.push_back(std::move(name));
    }
  }
  return scan;
}

// The changes of a guard: `norm` for the norm ops, `rest` for every other op
// with a kernel on the key. The scan is kept until an operator is defined or
// removed; ampx's own policies set since then (set_cast_policy on an op
// PyTorch has no autocast kernel for) are added each time.
Changes whole_set(c10::DeviceType device_type, const char* who, detail::PolicyEntry norm,
                  detail::PolicyEntry rest) {
  const auto key = detail::autocast_key(device_type, who);
  // Registered once, removed at exit: this static is constructed after the
  // dispatcher's, so it is destroyed before it. (A handle leaked on purpose
  // was LeakSanitizer's one report on LibTorch 2.6.)
  static const c10::RegistrationHandleRAII listening =
      c10::Dispatcher::singleton().addRegistrationListener(std::make_unique<DefinitionCounter>());
  (void)listening;
  static std::mutex mutex;
  static std::map<int, OpScan> scans;
  std::lock_guard<std::mutex> lock(mutex);
  OpScan& scan = scans[static_cast<int>(device_type)];
  const uint64_t definitions = g_op_definitions.load();
  if (!scan.valid || scan.definitions != definitions) {
    scan = scan_ops(key, device_type);
    scan.valid = true;
    scan.definitions = definitions;
  }
  Changes changes;
  changes.reserve(scan.norm.size() + scan.rest.size());
  for (const auto& name : scan.norm) changes.emplace_back(name, norm);
  for (const auto& name : scan.rest) changes.emplace_back(name, rest);
  for (auto& name : detail::ops_with_policy(device_type)) {
    if (scan.listed.count(detail::op_string(name)) == 0) {
      changes.emplace_back(std::move(name), rest);
    }
  }
  return changes;
}

}  // namespace

std::vector<std::string> norm_ops() {
  std::vector<std::string> out;
  auto& dispatcher = c10::Dispatcher::singleton();
  const auto all = dispatcher.getAllOpNames();
  for (const char* op : kNormOps) {
    const std::string name = std::string("aten::") + op;
    for (const auto& n : all) {
      if (n.name == name) {
        out.push_back(name);
        break;
      }
    }
  }
  return out;
}

KeepNormsFp32Guard::KeepNormsFp32Guard(c10::DeviceType device_type) {
  saved_ = detail::set_policies(
      device_type, whole_set(device_type, "KeepNormsFp32Guard",
                             detail::PolicyEntry{CastPolicy::kFp32OutputsAsInput, false},
                             detail::PolicyEntry{CastPolicy::kPassthrough, /*fallthrough=*/true}));
  try {
    autocast_ = std::make_unique<AutocastGuard>(device_type);
  } catch (...) {
    detail::restore_policies(*saved_);
    throw;
  }
}

KeepNormsFp32Guard::~KeepNormsFp32Guard() {
  autocast_.reset();
  detail::restore_policies(*saved_);
}

namespace {

// The products a WideProductsGuard routes (see wide_product in kernel.cpp).
const char* const kProductOps[] = {"aten::linear", "aten::matmul", "aten::mm", "aten::bmm",
                                   "aten::addmm"};
// And attention, to ampx's fused kernel (routes_fused_attention).
constexpr const char* kAttentionOp = "aten::scaled_dot_product_attention";

}  // namespace

namespace detail {
bool routes_fused_attention() {
  return AMPX_TORCH_AT_LEAST(2, 1);
}

bool autocast_guard_wants_wide_products(c10::DeviceType device_type, c10::ScalarType dtype) {
  return device_type == c10::DeviceType::CPU &&
         (cpu_products_are_wide(dtype) || routes_fused_attention());
}
}  // namespace detail

WideProductsGuard::WideProductsGuard() {
  constexpr auto cpu = c10::DeviceType::CPU;
  const bool products = cpu_products_are_wide(c10::kBFloat16) || cpu_products_are_wide(c10::kHalf);
  if (!products && !detail::routes_fused_attention()) return;
  std::vector<const char*> routed;
  if (products) routed.assign(std::begin(kProductOps), std::end(kProductOps));
  if (detail::routes_fused_attention()) routed.push_back(kAttentionOp);
  const auto key = detail::autocast_key(cpu, "WideProductsGuard");
  const bool autocast_on = is_autocast_enabled(cpu);
  Changes changes;
  if (!autocast_on) {
    // Outside autocast (O2, O3): every other op runs as with autocast off.
    const detail::PolicyEntry off{CastPolicy::kPassthrough, /*fallthrough=*/true};
    changes = whole_set(cpu, "WideProductsGuard", off, off);
  }
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const char* op : routed) {
    for (auto& name : detail::resolve_op(op, "WideProductsGuard")) {
      // Inside autocast: the op keeps the casts it has now (ampx's policy,
      // else PyTorch's lower-precision cast where PyTorch has a kernel).
      detail::PolicyEntry entry{CastPolicy::kPassthrough, false, /*wide=*/true};
      if (autocast_on) {
        if (auto current = detail::get_policy(cpu, name)) {
          if (!current->fallthrough) entry.policy = current->policy;
          entry.inherited = current->inherited;
        } else {
          if (dispatcher.findOp(name)->hasKernelForDispatchKey(key)) {
            entry.policy = CastPolicy::kLowerPrecision;
          }
          entry.inherited = true;
        }
      }
      changes.emplace_back(std::move(name), entry);
    }
  }
  saved_ = detail::set_policies(cpu, changes);
  if (autocast_on) return;
  // Autocast on for the CPU, as AutocastGuard(cpu) turns it on, but a region
  // only: AutocastGuard would make a WideProductsGuard of its own.
  try {
    autocast_ = std::make_unique<detail::AutocastRegion>(cpu, c10::nullopt, /*enabled=*/true,
                                                         /*cache_enabled=*/true);
  } catch (...) {
    detail::restore_policies(*saved_);
    throw;
  }
}

WideProductsGuard::~WideProductsGuard() {
  autocast_.reset();
  if (saved_) detail::restore_policies(*saved_);
}

Fp32RegionGuard::Fp32RegionGuard(c10::DeviceType device_type) {
  const detail::PolicyEntry fp32{CastPolicy::kFp32, false};
  saved_ = detail::set_policies(device_type, whole_set(device_type, "Fp32RegionGuard", fp32, fp32));
  try {
    autocast_ = std::make_unique<AutocastGuard>(device_type);
  } catch (...) {
    detail::restore_policies(*saved_);
    throw;
  }
}

Fp32RegionGuard::~Fp32RegionGuard() {
  autocast_.reset();
  detail::restore_policies(*saved_);
}

}  // namespace ampx
