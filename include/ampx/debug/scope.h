#pragma once

/// \file
/// Names for regions of a model, so that ampx's numerics diagnostics
/// (NonFiniteGuard, RangeStatsCollector) can say where an op ran. LibTorch has
/// no forward hooks; two cheap mechanisms stand in for them:
///
/// ```
///   ampx::debug::name_modules(*model);        // every submodule by its path:
///                                             // ops that take a parameter of
///                                             // "blocks.2.mlp.fc1" run in that scope
///   struct BlockImpl : torch::nn::Module {
///     torch::Tensor forward(torch::Tensor x) {
///       ampx::debug::ModuleScopeGuard scope(*this);  // "blocks.2" once named
///       ...                                     // gelu, softmax, adds: here
///     }
///   };
///   { ampx::debug::NamedScopeGuard scope("loss"); loss = criterion(logits, y); }
///   ampx::debug::current_scope();              // "loss"
/// ```
///
/// The innermost scope wins. A scope costs a push and a pop on a thread-local
/// stack when no diagnostic is alive, and nothing else. Scopes belong to the
/// thread that opened them; ops that autograd runs in backward are attributed
/// to the scope their forward op ran in.

#include <cstdint>
#include <string>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace ampx {
namespace debug {

/// Names every submodule of `root` by its path ("blocks.2.mlp.fc1", as
/// `named_modules()` spells it, under `prefix`) and every parameter by its
/// module's path, for ModuleScopeGuard and for the automatic attribution of ops
/// that take a parameter. Call again after adding modules; names of destroyed
/// modules are dropped on the next call. Thread safe.
void name_modules(const torch::nn::Module& root, const std::string& prefix = "");

/// Forgets every name registered by name_modules().
void clear_module_names();

/// The path name_modules() gave `module`, or its class name (`module.name()`)
/// when it was never named.
std::string module_path(const torch::nn::Module& module);

/// Opens a named region for the current thread until destroyed.
class NamedScopeGuard {
 public:
  /// Opens the scope `name`; the destructor closes it.
  explicit NamedScopeGuard(std::string name);
  ~NamedScopeGuard();
  NamedScopeGuard(const NamedScopeGuard&) = delete;
  NamedScopeGuard& operator=(const NamedScopeGuard&) = delete;
};

/// A NamedScopeGuard named by module_path(module).
class ModuleScopeGuard {
 public:
  /// Opens the scope module_path(module); the destructor closes it.
  explicit ModuleScopeGuard(const torch::nn::Module& module);
  ~ModuleScopeGuard();
  ModuleScopeGuard(const ModuleScopeGuard&) = delete;
  ModuleScopeGuard& operator=(const ModuleScopeGuard&) = delete;
};

/// The innermost open scope of this thread, "" outside any.
std::string current_scope();

/// A scope as reports and tables show it: `scope`, or "(top level)" for ""
/// (outside any scope).
std::string scope_label(const std::string& scope);

}  // namespace debug
}  // namespace ampx
