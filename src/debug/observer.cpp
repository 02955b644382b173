#include "observer.h"

#include "scope_internal.h"
#include "tensor_scan.h"

#include <ATen/core/function_schema.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

namespace ampx {
namespace debug {
namespace detail {
namespace {

constexpr c10::DispatchKey kKey = kObserverKey;

// Factories whose outputs are uninitialised memory: never inspected.
const std::unordered_set<std::string>& uninitialised_ops() {
  static const std::unordered_set<std::string> ops = {"aten::empty",
                                                      "aten::empty_like",
                                                      "aten::empty_strided",
                                                      "aten::new_empty",
                                                      "aten::new_empty_strided",
                                                      "aten::resize_",
                                                      "aten::resize_as_",
                                                      "aten::_empty_affine_quantized",
                                                      "aten::empty_quantized",
                                                      "aten::set_"};
  return ops;
}

struct Global {
  std::mutex mutex;
  std::vector<Observer*> observers;
  std::unique_ptr<torch::Library> library;  // the fallback, while observers live
};
Global& global() {
  static Global* g = new Global();
  return *g;
}

struct ThreadState {
  int observers = 0;  // live observers owned by this thread
  at::CallbackHandle callback = 0;
  bool busy = false;  // inside an observer: its own ops pass through
  int depth = 0;      // nesting of observed ops
  // Outputs inspected during the current top-level op: (data, numel, dtype).
  std::vector<std::tuple<const void*, int64_t, c10::ScalarType>> seen;
  std::vector<std::pair<std::string, std::string>> nodes;  // backward: (node, scope)
};
thread_local ThreadState t_state;

// Autograd runs a node inside a RecordFunction of scope BACKWARD_FUNCTION;
// its sequence number and forward thread name the forward op's scope.
std::unique_ptr<at::ObserverContext> on_node_start(const at::RecordFunction& fn) {
  t_state.nodes.emplace_back(fn.name(), scope_of_sequence_nr(fn.forwardThreadId(), fn.seqNr()));
  return nullptr;
}
void on_node_end(const at::RecordFunction&, at::ObserverContext*) {
  if (!t_state.nodes.empty()) t_state.nodes.pop_back();
}

std::vector<Observer*> observers_for_this_thread() {
  auto& g = global();
  std::lock_guard<std::mutex> lock(g.mutex);
  const auto me = std::this_thread::get_id();
  std::vector<Observer*> mine;
  for (auto* o : g.observers) {
    if (o->owner() == me) mine.push_back(o);
  }
  // A thread with none of its own (autograd's device threads) serves them all.
  return mine.empty() ? g.observers : mine;
}

// Ops that take a named parameter run in that parameter's module scope.
class ParameterScope {
 public:
  explicit ParameterScope(c10::ArrayRef<c10::IValue> inputs) {
    if (!any_parameter_named()) return;
    ParameterName name;
    for (const auto& v : inputs) {
      if (!v.isTensor()) continue;
      const auto& t = v.toTensor();
      if (!t.defined() || !parameter_name(t.unsafeGetTensorImpl(), &name)) continue;
      if (name.module_path == innermost_scope()) return;
      push_scope(name.module_path);
      pushed_ = true;
      return;
    }
  }
  ~ParameterScope() {
    if (pushed_) pop_scope();
  }

 private:
  bool pushed_ = false;
};

// Whether `op` is a composition of other ops (CompositeImplicitAutograd):
// such an op touches no data itself, so what it returns was last written by
// a nested op, which was inspected then. Kernels of their own (addmm copies
// its bias into the result, then multiplies in place) are always inspected.
bool is_composite(const c10::OperatorHandle& op) {
  thread_local std::unordered_map<const void*, bool> cache;
  const void* key = &op.schema();
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const bool composite = op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
  cache.emplace(key, composite);
  return composite;
}

// The floating outputs of an op worth inspecting: not views (their base was
// inspected) and, for a composite op, not data a nested op produced.
std::vector<OutputTensor> fresh_floating_outputs(const c10::OperatorHandle& op,
                                                 c10::ArrayRef<c10::IValue> outputs,
                                                 ThreadState* state) {
  std::vector<OutputTensor> out;
  const bool composite = is_composite(op);
  const auto& returns = op.schema().returns();
  for (size_t i = 0; i < outputs.size() && i < returns.size(); ++i) {
    const auto* alias = returns[i].alias_info();
    if (alias && !alias->isWrite()) continue;
    const bool written = alias != nullptr;
    auto add = [&](const at::Tensor& t) {
      if (!t.defined() || !t.is_floating_point() || t.numel() == 0 || t.is_sparse() ||
          t.layout() != c10::kStrided) {
        return;
      }
      const auto key =
          std::make_tuple(static_cast<const void*>(t.data_ptr()), t.numel(), t.scalar_type());
      if (composite && !written &&
          std::find(state->seen.begin(), state->seen.end(), key) != state->seen.end()) {
        return;
      }
      state->seen.push_back(key);
      out.push_back(OutputTensor{i, t, written});
    };
    const auto& v = outputs[i];
    if (v.isTensor()) {
      add(v.toTensor());
    } else if (v.isTensorList()) {
      const c10::List<at::Tensor> list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) add(list.get(j));
    }
  }
  return out;
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey);
  auto& state = t_state;
  const auto& schema = op.schema();
  const bool in_backward = !state.nodes.empty();
  if (state.busy || schema.name().rfind("c10d::", 0) == 0 ||
      uninitialised_ops().count(schema.name())) {
    op.redispatchBoxed(below, stack);
    return;
  }
  const size_t num_args = schema.arguments().size();
  std::vector<c10::IValue> inputs(stack->end() - static_cast<std::ptrdiff_t>(num_args),
                                  stack->end());
  {
    ParameterScope parameter_scope(inputs);
    ++state.depth;
    struct Leave {
      ~Leave() {
        if (--t_state.depth == 0) t_state.seen.clear();
      }
    } leave;
    op.redispatchBoxed(below, stack);
    const size_t num_returns = schema.returns().size();
    if (num_returns == 0 || stack->size() < num_returns) return;

    OpEvent event;
    event.op = &op;
    event.name = &schema.name();
    event.direction = in_backward ? Direction::kBackward : Direction::kForward;
    static const std::string kNone;
    // In backward, the scope of the forward op that made the node.
    const std::string scope = in_backward && !state.nodes.back().second.empty()
                                  ? state.nodes.back().second
                                  : innermost_scope();
    event.scope = &scope;
    event.backward_node = in_backward ? &state.nodes.back().first : &kNone;
    event.inputs = inputs;
    event.outputs =
        c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - num_returns, num_returns);
    event.tensors = fresh_floating_outputs(op, event.outputs, &state);
    if (event.tensors.empty()) return;

    state.busy = true;
    struct Unbusy {
      ~Unbusy() { t_state.busy = false; }
    } unbusy;
    c10::impl::ExcludeDispatchKeyGuard exclude(kKey);
    at::AutoGradMode no_grad(false);
    for (auto* observer : observers_for_this_thread()) {
      if (observer->wants(event.direction)) observer->on_op(event);
    }
  }
}

}  // namespace

Observer::Observer(bool forward, bool backward)
    : forward_(forward), backward_(backward), owner_(std::this_thread::get_id()) {}

void attach(Observer* observer) {
  auto& g = global();
  {
    std::lock_guard<std::mutex> lock(g.mutex);
    if (!g.library) {
      try {
        auto library =
            std::make_unique<torch::Library>(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
        library->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
        g.library = std::move(library);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false,
                    "ampx::debug: cannot register the dispatcher fallback on "
                    "TESTING_ONLY_GenericMode that NonFiniteGuard and RangeStatsCollector use "
                    "(is something else using that key?): ",
                    e.what_without_backtrace());
      }
    }
    g.observers.push_back(observer);
  }
  auto& state = t_state;
  if (state.observers++ == 0) {
    c10::impl::tls_set_dispatch_key_included(kKey, true);
    state.callback =
        at::addThreadLocalCallback(at::RecordFunctionCallback(&on_node_start, &on_node_end)
                                       .scopes({at::RecordScope::BACKWARD_FUNCTION}));
  }
  set_recording(true);
}

void detach(Observer* observer) {
  auto& state = t_state;
  if (--state.observers == 0) {
    c10::impl::tls_set_dispatch_key_included(kKey, false);
    at::removeCallback(state.callback);
    state.callback = 0;
    state.nodes.clear();
  }
  set_recording(false);
  auto& g = global();
  std::lock_guard<std::mutex> lock(g.mutex);
  g.observers.erase(std::remove(g.observers.begin(), g.observers.end(), observer),
                    g.observers.end());
  if (g.observers.empty()) g.library.reset();
}

std::vector<TensorSummary> summarize_inputs(const OpEvent& event) {
  std::vector<TensorSummary> out;
  const auto& args = event.op->schema().arguments();
  for (size_t i = 0; i < event.inputs.size() && i < args.size(); ++i) {
    const auto* alias = args[i].alias_info();
    const bool written = alias != nullptr && alias->isWrite();
    auto add = [&](const at::Tensor& t, const std::string& name) {
      if (!t.defined()) return;
      TensorSummary s;
      s.name = name;
      s.written = written;
      s.dtype = t.scalar_type();
      s.shape = t.sizes().vec();
      if (t.is_floating_point() && t.layout() == c10::kStrided && t.numel() > 0) {
        const auto scan = scan_finite(t);
        s.abs_max = scan.abs_max;
        s.non_finite = scan.nan + scan.inf;
      } else if (t.numel() > 0 && t.layout() == c10::kStrided && !t.is_complex() &&
                 t.scalar_type() != at::kBool) {
        s.abs_max = t.abs().max().to(at::kDouble).item<double>();
      }
      ParameterName pn;
      if (parameter_name(t.unsafeGetTensorImpl(), &pn)) s.parameter = pn.full_name;
      out.push_back(std::move(s));
    };
    const auto& v = event.inputs[i];
    if (v.isTensor()) {
      add(v.toTensor(), args[i].name());
    } else if (v.isTensorList()) {
      const c10::List<at::Tensor> list = v.toTensorList();
      for (size_t k = 0; k < list.size(); ++k) {
        add(list.get(k), args[i].name() + "[" + std::to_string(k) + "]");
      }
    }
  }
  return out;
}

}  // namespace detail
}  // namespace debug
}  // namespace ampx
