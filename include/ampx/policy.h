#pragma once

/// \file
/// Cast policies users control: which ops autocast casts, and to what. PyTorch
/// fixes its op lists at build time (pytorch#117832); ampx changes them at run
/// time by registering a kernel for the op on the device's Autocast dispatch
/// key (AutocastCPU, AutocastCUDA), which shadows PyTorch's own autocast kernel
/// for that op until ampx drops the registration. See docs/policy.md.
///
/// ```
///   {
///     ampx::AutocastGuard autocast(torch::kCUDA);
///     ampx::CastPolicyGuard policy(torch::kCUDA, {{"aten::mm", ampx::CastPolicy::kFp32},
///                                                {"aten::softmax",
///                                                ampx::CastPolicy::kLowerPrecision}});
///     auto y = torch::softmax(torch::mm(a, b), 1);   // mm in fp32, softmax in fp16
///   }                                                 // PyTorch's lists again
/// ```
///
/// Policies act only where autocast is on (AutocastGuard), in every thread.
/// Unlike autocast's enabled flag they are process-wide: the dispatcher is
/// global, so a policy set or a guard alive in one thread applies to autocast
/// regions of all threads. The registry is mutex-protected.

#include <c10/core/DeviceType.h>
#include <c10/util/Optional.h>

#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ampx {

/// What an op does with its floating tensor inputs inside an autocast region.
/// "Floating inputs" are, as in PyTorch, defined floating-point tensors on the
/// policy's device other than float64, in `Tensor`, `Tensor[]` and `Tensor?`
/// arguments; arguments the op writes (out=, in-place: `Tensor(a!)`) and
/// batch norm's running_mean/running_var (updated in place) are never cast.
enum class CastPolicy {
  /// Cast to the thread's autocast dtype (PyTorch's lower_precision_fp), with
  /// PyTorch's weight-cast cache (at::autocast::cached_cast).
  kLowerPrecision,
  /// Cast to float32 (PyTorch's fp32 list).
  kFp32,
  /// Cast to the widest floating dtype among the inputs (PyTorch's promote;
  /// float16 with bfloat16 gives float32).
  kPromote,
  /// No casts, and the op (with every op it calls) runs as with autocast off.
  kPassthrough,
  /// Cast to float32, run, and cast floating tensor outputs back to the dtype
  /// the first floating input had: Apex's recipe for norm layers kept in fp32.
  kFp32OutputsAsInput,
};

/// "kFp32", "kLowerPrecision", ...
const char* to_string(CastPolicy policy);

/// Sets the process-wide policy of `op` for autocast regions on `device_type`
/// (kCPU or kCUDA), replacing PyTorch's for that op.
///
/// `op` is a schema name with namespace: "aten::softmax" covers every overload
/// of softmax that writes none of its arguments (softmax.int,
/// softmax.Dimname; out= overloads such as mm.out are left alone, as in
/// PyTorch's lists); "aten::softmax.int" names one overload, whatever it is.
/// Overloads are looked up when the policy is set: the op must already be
/// registered (custom ops: load/define them first); overloads registered later
/// are not covered. Errors: unknown op, device other than cpu/cuda.
void set_cast_policy(c10::DeviceType device_type, const std::string& op, CastPolicy policy);

/// Drops ampx's policy for `op` (same naming as set_cast_policy): PyTorch's
/// own autocast kernel, or none, is active again.
void reset_cast_policy(c10::DeviceType device_type, const std::string& op);

/// Drops every policy ampx set for `device_type`, including those of live
/// guards (which then restore their saved state on exit as usual).
void reset_all_cast_policies(c10::DeviceType device_type);

/// ampx's policy for `op` on `device_type`; nullopt when ampx sets none (the
/// op follows PyTorch's lists). For a name covering several overloads, the
/// policy they all share; nullopt if they differ (ask per overload then).
c10::optional<CastPolicy> get_cast_policy(c10::DeviceType device_type, const std::string& op);

/// Every overload with an ampx policy on `device_type`, as
/// ("ns::name.overload", policy), sorted by name (guards' included).
std::vector<std::pair<std::string, CastPolicy>> get_all_cast_policies(c10::DeviceType device_type);

/// The overloads `op` covers, as "ns::name.overload" ("aten::softmax.int";
/// the default overload is "ns::name").
std::vector<std::string> cast_policy_overloads(const std::string& op);

namespace detail {
class PolicySnapshot;
class AutocastRegion;
}  // namespace detail
class AutocastGuard;

/// Sets policies for its lifetime and restores, on exit (also by exception),
/// each covered overload's previous policy, or PyTorch's. Nested guards
/// restore in reverse order. Process-wide like set_cast_policy: while the
/// guard lives, autocast regions of all threads see its policies.
class CastPolicyGuard {
 public:
  /// Sets each (op, policy) of `policies` on `device_type` as
  /// set_cast_policy does, after saving what it replaces.
  CastPolicyGuard(c10::DeviceType device_type,
                  std::initializer_list<std::pair<std::string, CastPolicy>> policies);
  /// The same, from a vector.
  CastPolicyGuard(c10::DeviceType device_type,
                  const std::vector<std::pair<std::string, CastPolicy>>& policies);
  ~CastPolicyGuard();

  CastPolicyGuard(const CastPolicyGuard&) = delete;
  CastPolicyGuard& operator=(const CastPolicyGuard&) = delete;
  CastPolicyGuard(CastPolicyGuard&&) = delete;
  CastPolicyGuard& operator=(CastPolicyGuard&&) = delete;

 private:
  std::unique_ptr<detail::PolicySnapshot> saved_;
};

/// Ready-made sets of policies.
enum class CastPolicyPreset {
  /// No ampx policies: PyTorch's lists for this LibTorch version.
  kPyTorch,
  /// Apex O1's lists (FP16_FUNCS, FP32_FUNCS, CASTS, SEQUENCE_CASTS of
  /// apex.amp.lists) mapped onto the ATen ops that exist, on top of PyTorch's.
  /// Apex's elementwise CASTS (add, mul, div, comparisons) are left to ATen's
  /// type promotion, which gives the same dtypes without a boxed kernel.
  kApexO1,
};

/// The (op, policy) pairs of a preset, for ops registered in this build.
std::vector<std::pair<std::string, CastPolicy>> cast_policy_preset(CastPolicyPreset preset);

/// Drops all policies of `device_type`, then sets the preset's.
void apply_cast_policy_preset(c10::DeviceType device_type, CastPolicyPreset preset);

/// A preset for a scope: kPyTorch resets every ampx policy of the device while
/// it lives, kApexO1 sets Apex's on top of the current ones; both restore.
class CastPolicyPresetGuard {
 public:
  /// Applies `preset` on `device_type` after saving the current policies.
  CastPolicyPresetGuard(c10::DeviceType device_type, CastPolicyPreset preset);
  ~CastPolicyPresetGuard();

  CastPolicyPresetGuard(const CastPolicyPresetGuard&) = delete;
  CastPolicyPresetGuard& operator=(const CastPolicyPresetGuard&) = delete;
  CastPolicyPresetGuard(CastPolicyPresetGuard&&) = delete;
  CastPolicyPresetGuard& operator=(CastPolicyPresetGuard&&) = delete;

 private:
  std::unique_ptr<detail::PolicySnapshot> saved_;
};

/// The normalization ops KeepNormsFp32Guard and Fp32RegionGuard act on, by the
/// names that exist in this build: batch_norm, _batch_norm_impl_index,
/// native_batch_norm, _native_batch_norm_legit(_no_training) (2.x),
/// layer_norm, native_layer_norm, group_norm, native_group_norm,
/// instance_norm. The C++ modules and functionals (BatchNorm*, LayerNorm,
/// GroupNorm, InstanceNorm*) enter through the first op of each family.
std::vector<std::string> norm_ops();

/// Apex O2's keep_batchnorm_fp32 for a model whose parameters are bf16/fp16
/// except its norm layers: while it lives, on `device_type`,
/// - the norm ops (norm_ops()) get kFp32OutputsAsInput: a bf16 input meets
///   the layer's fp32 weight and buffers in fp32 and leaves in bf16;
/// - on the CPU, aten::gelu (exact) gets it too: a bf16/fp16 GELU runs
///   ampx::mixed_gelu, the same float32 math in one vectorized pass each way
///   (LibTorch 1.13's bf16 backward is several times slower);
/// - every other op runs exactly as with autocast off: no casts anywhere.
/// Mechanism: the guard turns autocast on for this thread (an AutocastGuard,
/// so the ops meet the device's Autocast key) and, process-wide, registers a
/// fallthrough for every op that has a kernel on that key when the guard is
/// made (PyTorch's lists, enumerated from the dispatcher, and any ampx or user
/// policy) plus the norm kernels. On exit (also by exception) the
/// registrations and the thread's autocast state are restored.
///
/// Caveats: the registrations are process-wide, so autocast regions of other
/// threads on the device see the same "norms only" policy while the guard
/// lives; autocast kernels registered after the guard is made keep acting;
/// an op that asks is_autocast_enabled() itself sees true. Which ops have an
/// autocast kernel is found by scanning the dispatcher at the first guard of
/// the process and again whenever an operator has been defined since; an
/// Autocast kernel that another library adds to an existing operator after
/// that scan keeps acting inside later guards (ampx's own policies are always
/// seen). Making the guard costs a few hundred dispatcher registrations,
/// about 0.2 ms (see docs/policy.md): make it around a forward pass, not
/// around each op.
class KeepNormsFp32Guard {
 public:
  /// Keeps the norms in fp32 on `device_type` (kCPU or kCUDA) until destroyed.
  explicit KeepNormsFp32Guard(c10::DeviceType device_type);
  ~KeepNormsFp32Guard();

  KeepNormsFp32Guard(const KeepNormsFp32Guard&) = delete;
  KeepNormsFp32Guard& operator=(const KeepNormsFp32Guard&) = delete;
  KeepNormsFp32Guard(KeepNormsFp32Guard&&) = delete;
  KeepNormsFp32Guard& operator=(KeepNormsFp32Guard&&) = delete;

 private:
  std::unique_ptr<detail::PolicySnapshot> saved_;
  std::unique_ptr<AutocastGuard> autocast_;
};

/// 16-bit matrix products on the CPU through the float32 BLAS while it lives
/// (ampx::wide_linear, wide_bmm, wide_matmul; CpuProducts in ampx/kernels.h):
/// linear, matmul, mm, bmm and addmm (1-D bias) whose operands are CPU
/// tensors of a 16-bit dtype for which cpu_products_are_wide() holds are
/// computed in float32 and rounded once to that dtype, forward and backward.
/// Where no 16-bit dtype is wide (LibTorch's 16-bit products at least 0.8 of
/// its float32 rate, or set_cpu_products(CpuProducts::kNative)) the guard
/// routes no product.
///
/// Inside an autocast region (AutocastGuard, KeepNormsFp32Guard) each of
/// these ops keeps its casts (PyTorch's lower-precision cast, or ampx's
/// policy for it) and then multiplies wide; AutocastGuard makes one itself on
/// such CPUs, so O1 needs nothing more. Outside one (O2's model without norm
/// layers, O3) the guard turns autocast on for this thread with every other op
/// passing through untouched, as KeepNormsFp32Guard does; AmpSession's
/// forward_guard() makes it for O2 and O3. Other shapes (1-D operands,
/// broadcast batch sizes, addmm with a 2-D input or beta/alpha other than 1)
/// run LibTorch's own kernel. Registrations are process-wide and restored on
/// exit, also by exception, with the caveats of KeepNormsFp32Guard.
///
/// On LibTorch 2.1+ it also routes attention, on every CPU (wide products or
/// not): `at::scaled_dot_product_attention` of bfloat16/float16 CPU tensors
/// without attn_mask, dropout or enable_gqa runs
/// ampx::scaled_dot_product_attention's fused kernel (other calls run ATen's).
/// So O1's AutocastGuard and O2's and O3's forward guard make one there even
/// where products are native.
class WideProductsGuard {
 public:
  WideProductsGuard();
  ~WideProductsGuard();

  WideProductsGuard(const WideProductsGuard&) = delete;
  WideProductsGuard& operator=(const WideProductsGuard&) = delete;
  WideProductsGuard(WideProductsGuard&&) = delete;
  WideProductsGuard& operator=(WideProductsGuard&&) = delete;

 private:
  std::unique_ptr<detail::PolicySnapshot> saved_;
  std::unique_ptr<detail::AutocastRegion> autocast_;  // outside autocast: a region of its own
};

/// A region that must compute in float32 inside (or outside) an autocast
/// region: while it lives, on `device_type`, autocast casts to float32 where it
/// would have cast at all. Precisely: every op that has a kernel on the
/// device's Autocast key when the guard is made (PyTorch's lower-precision,
/// fp32 and promote lists, ampx and user policies) and the norm ops
/// (norm_ops()) get kFp32, i.e. their bf16/fp16 floating inputs are cast to
/// float32 and they compute and return float32; ops autocast leaves alone are
/// left alone here too (they see their inputs as they come: relu of a bf16
/// tensor is bf16; add of bf16 and fp32 is fp32 by type promotion).
/// Mechanism and caveats as for KeepNormsFp32Guard (thread-local autocast on,
/// process-wide registrations); restored on exit, also by exception.
class Fp32RegionGuard {
 public:
  /// Opens the float32 region on `device_type` (kCPU or kCUDA).
  explicit Fp32RegionGuard(c10::DeviceType device_type);
  ~Fp32RegionGuard();

  Fp32RegionGuard(const Fp32RegionGuard&) = delete;
  Fp32RegionGuard& operator=(const Fp32RegionGuard&) = delete;
  Fp32RegionGuard(Fp32RegionGuard&&) = delete;
  Fp32RegionGuard& operator=(Fp32RegionGuard&&) = delete;

 private:
  std::unique_ptr<detail::PolicySnapshot> saved_;
  std::unique_ptr<AutocastGuard> autocast_;
};

}  // namespace ampx
