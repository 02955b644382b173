#pragma once

// ampx's cast-policy registry, shared by src/policy/*.cpp: one dispatcher
// registration per (device, operator overload) that has an ampx policy.

#include "ampx/policy.h"

#include <ATen/core/function_schema.h>
#include <ATen/core/operator_name.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/core/DispatchKey.h>
#include <c10/util/Optional.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace ampx {
namespace detail {

/// A policy as the registry stores it: a public CastPolicy, or a fallthrough
/// (the guards' "autocast off" for ops PyTorch has autocast kernels for; no
/// boxing cost, nested ops still meet the Autocast key).
struct PolicyEntry {
  CastPolicy policy = CastPolicy::kPassthrough;
  bool fallthrough = false;
  /// CPU products (WideProductsGuard): after the policy's casts, a product
  /// of 16-bit operands runs ampx::wide_linear / wide_matmul when
  /// cpu_products_are_wide says so.
  bool wide = false;
  /// A WideProductsGuard's entry for an op ampx had no policy for: `policy`
  /// is PyTorch's own, so the public getters and reset_all_cast_policies
  /// treat the op as having no ampx policy.
  bool inherited = false;
  bool operator==(const PolicyEntry& o) const {
    return policy == o.policy && fallthrough == o.fallthrough && wide == o.wide &&
           inherited == o.inherited;
  }
};

/// The Autocast dispatch key of a device (kCPU, kCUDA); errors for others.
c10::DispatchKey autocast_key(c10::DeviceType device_type, const char* who);

/// "ns::name" or "ns::name.overload" → the overloads it covers (see
/// set_cast_policy). Errors when none is registered.
std::vector<c10::OperatorName> resolve_op(const std::string& op, const char* who);

/// "ns::name.overload" ("ns::name" for the default overload).
std::string op_string(const c10::OperatorName& name);

/// Whether an op writes `arg` (out=, in-place: `Tensor(a!)`).
bool writes_argument(const c10::Argument& arg);
/// Whether an op writes any of its arguments (not functional).
bool writes_an_argument(const c10::FunctionSchema& schema);

/// Saved per-overload state, restored in reverse order.
class PolicySnapshot {
 public:
  using Item = std::tuple<c10::DeviceType, c10::OperatorName, c10::optional<PolicyEntry>>;
  std::vector<Item> items;
};

/// Sets (entry) or drops (nullopt) ampx's policy for each overload on a
/// device; returns the previous state for restore_policies.
std::unique_ptr<PolicySnapshot> set_policies(
    c10::DeviceType device_type,
    const std::vector<std::pair<c10::OperatorName, c10::optional<PolicyEntry>>>& changes);

/// Restores a snapshot (no-throw: errors are reported as warnings).
void restore_policies(PolicySnapshot& snapshot) noexcept;

c10::optional<PolicyEntry> get_policy(c10::DeviceType device_type, const c10::OperatorName& op);

/// Every overload with an ampx policy on `device_type`.
std::vector<c10::OperatorName> ops_with_policy(c10::DeviceType device_type);

}  // namespace detail
}  // namespace ampx

namespace c10 {
class KernelFunction;
}
namespace ampx {
namespace detail {
/// Whether an enabled AutocastGuard on `device_type` with `dtype` makes a
/// WideProductsGuard (the CPU, products wide for dtype or 16-bit attention
/// routed to ampx's kernel).
bool autocast_guard_wants_wide_products(c10::DeviceType device_type, c10::ScalarType dtype);
/// Whether WideProductsGuard routes 16-bit CPU aten::scaled_dot_product_attention
/// to ampx::scaled_dot_product_attention: on every LibTorch that has the op
/// with a scale argument (2.1+), on any CPU.
bool routes_fused_attention();
/// The Autocast-key kernel that applies `entry` on `device_type` (kernel.cpp).
c10::KernelFunction make_policy_kernel(PolicyEntry entry, c10::DeviceType device_type);
}  // namespace detail
}  // namespace ampx
