#include "ampx/debug/nonfinite.h"

#include "ampx/debug/scope.h"
#include "observer.h"
#include "scope_internal.h"
#include "tensor_scan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <iomanip>
#include <sstream>
#include <unordered_map>
#include <utility>

namespace ampx {
namespace debug {
namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

std::string number(double v) {
  std::ostringstream s;
  s << std::setprecision(5) << v;
  return s.str();
}

std::vector<int64_t> unravel(int64_t flat, const std::vector<int64_t>& shape) {
  std::vector<int64_t> index(shape.size(), 0);
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] == 0) break;
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  return index;
}

}  // namespace

bool NonFiniteReport::propagated() const {
  return std::any_of(inputs.begin(), inputs.end(),
                     [](const TensorSummary& s) { return s.non_finite > 0 && !s.written; });
}

std::string NonFiniteReport::message() const {
  std::ostringstream m;
  m << "non-finite values from " << op << " in " << to_string(direction);
  if (!backward_node.empty()) m << " (" << backward_node << ")";
  m << ", scope " << (scope.empty() ? scope_label(scope) : "'" + scope + "'");
  if (step >= 0) m << ", step " << step;
  m << ": output " << output_index << " (" << c10::toString(dtype) << " " << shape_string(shape)
    << ") has " << nan_count << " NaN and " << inf_count << " inf of " << numel
    << " values; first at " << shape_string(first_index) << " = " << number(first_value);
  if (in_place) m << " (written in place)";
  m << ". Inputs:";
  if (inputs.empty()) m << " none";
  for (const auto& in : inputs) {
    m << " " << in.name;
    if (!in.parameter.empty()) m << " (parameter " << in.parameter << ")";
    if (in.written) m << " (written)";
    m << " " << c10::toString(in.dtype) << " " << shape_string(in.shape) << " abs max "
      << number(in.abs_max);
    if (in.non_finite > 0) m << ", " << in.non_finite << " non-finite";
    m << ";";
  }
  if (in_place) m << " Written inputs show their values after the op.";
  if (propagated()) {
    m << " An input already held non-finite values: the op propagated them; they came "
         "from outside the guarded region or from an op that was not checked.";
  } else {
    m << " All inputs were finite: this op created the non-finite values.";
  }
  return m.str();
}

NonFiniteError::NonFiniteError(NonFiniteReport report)
    : c10::Error(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                 report.message()),
      report_(std::move(report)) {}

struct NonFiniteGuard::Impl : detail::Observer {
  Impl(const NonFiniteOptions& o)
      : Observer(o.forward(), o.backward()), options(o), step(o.step()) {}

  void on_op(const detail::OpEvent& event) override {
    for (const auto& out : event.tensors) {
      const auto quick = detail::scan_finite(out.tensor, /*full=*/false);
      if (quick.nan + quick.inf == 0) continue;
      if (deliberate(event)) {
        mark_deliberate(out.tensor);
        continue;
      }
      ++count;
      if (options.action() == NonFiniteAction::kWarn &&
          static_cast<int64_t>(reports.size()) >= options.max_reports()) {
        continue;
      }
      auto report = make_report(event, out);
      if (options.action() == NonFiniteAction::kThrow) throw NonFiniteError(std::move(report));
      TORCH_WARN("ampx::debug::NonFiniteGuard: ", report.message());
      reports.push_back(std::move(report));
    }
  }

  NonFiniteReport make_report(const detail::OpEvent& event, const detail::OutputTensor& out) {
    const auto scan = detail::scan_finite(out.tensor, /*full=*/true);
    NonFiniteReport r;
    r.op = *event.name;
    r.direction = event.direction;
    r.scope = *event.scope;
    r.backward_node = *event.backward_node;
    r.step = step.load(std::memory_order_relaxed);
    r.output_index = out.output_index;
    r.dtype = out.tensor.scalar_type();
    r.shape = out.tensor.sizes().vec();
    r.numel = out.tensor.numel();
    r.nan_count = scan.nan;
    r.inf_count = scan.inf;
    r.first_index = unravel(scan.first_bad, r.shape);
    r.first_value = scan.first_value;
    r.in_place = out.written;
    r.inputs = detail::summarize_inputs(event);
    return r;
  }

  // Values a program writes on purpose are not faults: an op given an inf or
  // NaN scalar (masked_fill(mask, -inf) for attention, full(-inf)) makes
  // deliberate non-finite values, and so does an op whose only non-finite
  // inputs hold deliberate ones (mask + scores). Tracked by weak reference.
  bool deliberate(const detail::OpEvent& event) {
    for (const auto& v : event.inputs) {
      if (v.isDouble() && !std::isfinite(v.toDouble())) return true;
      // A Scalar argument that reached the op as a wrapped-number tensor.
      if (v.isTensor() && v.toTensor().defined() &&
          v.toTensor().unsafeGetTensorImpl()->is_wrapped_number() &&
          v.toTensor().is_floating_point() && !std::isfinite(v.toTensor().item<double>())) {
        return true;
      }
    }
    const auto& args = event.op->schema().arguments();
    bool any_bad_input = false;
    for (size_t i = 0; i < event.inputs.size() && i < args.size(); ++i) {
      const auto* alias = args[i].alias_info();
      if (alias && alias->isWrite()) continue;  // holds the op's result already
      const auto& v = event.inputs[i];
      if (!v.isTensor()) continue;
      const auto& t = v.toTensor();
      if (!t.defined() || !t.is_floating_point() || t.numel() == 0) continue;
      const auto scan = detail::scan_finite(t, /*full=*/false);
      if (scan.nan + scan.inf == 0) continue;
      any_bad_input = true;
      if (!is_deliberate(t)) return false;
    }
    return any_bad_input;
  }
  // By storage: views and reshapes of a deliberate tensor are deliberate too.
  bool is_deliberate(const at::Tensor& t) const {
    if (!t.has_storage()) return false;
    auto it = deliberate_values.find(t.storage().unsafeGetStorageImpl());
    return it != deliberate_values.end() && !it->second.expired();
  }
  void mark_deliberate(const at::Tensor& t) {
    if (!t.has_storage()) return;
    if (deliberate_values.size() > 4096) {
      for (auto it = deliberate_values.begin(); it != deliberate_values.end();) {
        it = it->second.expired() ? deliberate_values.erase(it) : std::next(it);
      }
    }
    const auto& storage = t.storage();
    deliberate_values.insert_or_assign(storage.unsafeGetStorageImpl(),
                                       storage.getWeakStorageImpl());
  }

  NonFiniteOptions options;
  std::atomic<int64_t> step;  // read by autograd's device threads too
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>>
      deliberate_values;
  std::vector<NonFiniteReport> reports;
  int64_t count = 0;
};

NonFiniteGuard::NonFiniteGuard(NonFiniteOptions options) {
  TORCH_CHECK(options.max_reports() >= 0, "NonFiniteGuard: max_reports must be >= 0, got ",
              options.max_reports());
  impl_ = std::make_unique<Impl>(options);
  detail::attach(impl_.get());
}

NonFiniteGuard::~NonFiniteGuard() {
  detail::detach(impl_.get());
}

const std::vector<NonFiniteReport>& NonFiniteGuard::reports() const {
  return impl_->reports;
}
int64_t NonFiniteGuard::count() const {
  return impl_->count;
}
void NonFiniteGuard::set_step(int64_t step) {
  impl_->step.store(step, std::memory_order_relaxed);
}

}  // namespace debug
}  // namespace ampx
