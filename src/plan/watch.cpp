// The watch: a plan checked while training runs (PlanWatch).

#include "ampx/precision_plan.h"

#include "ampx/dist.h"

#include "linears.h"

#include "ampx/fp8/autocast.h"
#include "ampx/fp8/convert.h"
#include "../fp8/convert_internal.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <mutex>
#include <sstream>

namespace ampx {
namespace plan {
namespace {

// What a check compares: one layer's gradient in its format and in bf16.
struct Comparison {
  double gradient_norm = 0;
  double noise_norm = 0;
  double underflow = 0;
  double non_finite = 0;
};

Comparison compare(const at::Tensor& in_format, const at::Tensor& bf16) {
  const at::Tensor q = in_format.to(at::kDouble);
  const at::Tensor ref = bf16.to(at::kDouble);
  Comparison c;
  const at::Tensor finite = q.isfinite();
  c.non_finite = 1.0 - finite.to(at::kDouble).mean().item<double>();
  c.gradient_norm = ref.norm().item<double>();
  c.noise_norm = at::where(finite, q - ref, at::zeros_like(q)).norm().item<double>();
  const at::Tensor nonzero = ref != 0;
  const int64_t count = nonzero.sum().item<int64_t>();
  if (count > 0) {
    c.underflow = static_cast<double>((nonzero & (q == 0)).sum().item<int64_t>()) /
                  static_cast<double>(count);
  }
  return c;
}

// What a check decided for one layer: its numbers, its finding (if any) and
// the format it moves to (its own when it stays).
struct Decision {
  Comparison numbers;
  c10::optional<WatchFinding> finding;
  LayerFormat moved_to = LayerFormat::kBFloat16;
};

// The event of a layer whose check found something (d.finding), before the
// layer moves.
WatchEvent event_of(int64_t step, const LayerPlan& l, const Decision& d) {
  WatchEvent e;
  e.step = step;
  e.module = l.module;
  e.format = l.format;
  e.finding = *d.finding;
  e.gradient_norm = d.numbers.gradient_norm;
  e.noise_norm = d.numbers.noise_norm;
  e.underflow = d.numbers.underflow;
  e.non_finite = d.numbers.non_finite;
  e.moved_to = d.moved_to;
  return e;
}

// Every rank of `group` takes rank 0's decisions, numbers, findings and
// moves alike (the ranks watch the same plan: the same layers in the same
// order), whatever its own numbers, thresholds or target.
void agree_on_rank0s(const dist::ProcessGroup& group, std::vector<Decision>& decisions) {
  at::Tensor t = at::empty({static_cast<int64_t>(decisions.size()), 6}, at::kDouble);
  auto a = t.accessor<double, 2>();
  for (size_t i = 0; i < decisions.size(); ++i) {
    const Decision& d = decisions[i];
    a[i][0] = d.numbers.gradient_norm;
    a[i][1] = d.numbers.noise_norm;
    a[i][2] = d.numbers.underflow;
    a[i][3] = d.numbers.non_finite;
    a[i][4] = d.finding ? static_cast<double>(*d.finding) : -1.0;
    a[i][5] = static_cast<double>(d.moved_to);
  }
  group.broadcast(t, 0);
  for (size_t i = 0; i < decisions.size(); ++i) {
    Decision& d = decisions[i];
    d.numbers = {a[i][0], a[i][1], a[i][2], a[i][3]};
    d.finding = a[i][4] < 0 ? c10::nullopt
                            : c10::optional<WatchFinding>(static_cast<WatchFinding>(a[i][4]));
    d.moved_to = static_cast<LayerFormat>(a[i][5]);
  }
}

// The most severe finding of one comparison, if any.
c10::optional<WatchFinding> worst_finding(const Comparison& c, const WatchOptions& o) {
  if (c.non_finite > 0) return WatchFinding::kOverflow;
  if (c.underflow > o.underflow_fraction()) return WatchFinding::kUnderflow;
  if (c.gradient_norm < o.noise_ratio() * c.noise_norm) return WatchFinding::kGradientBelowNoise;
  return c10::nullopt;
}

// Every gradient of `model`'s parameters (undefined where none), and back.
std::vector<at::Tensor> take_grads(torch::nn::Module& model) {
  std::vector<at::Tensor> grads;
  for (auto& p : model.parameters()) {
    grads.push_back(p.grad());
    p.mutable_grad() = at::Tensor();
  }
  return grads;
}

void put_grads(torch::nn::Module& model, const std::vector<at::Tensor>& grads) {
  auto params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i];
}

// The default generators a model's forward draws from: the CPU's, and its
// CUDA device's when its parameters are there.
std::vector<at::Generator> generators_of(torch::nn::Module& model) {
  std::vector<at::Generator> out{at::detail::getDefaultCPUGenerator()};
  for (const auto& p : model.parameters()) {
    if (p.is_cuda()) {
      out.push_back(at::globalContext().defaultGenerator(p.device()));
      break;
    }
  }
  return out;
}

std::vector<at::Tensor> states_of(std::vector<at::Generator>& generators) {
  std::vector<at::Tensor> states;
  for (auto& g : generators) {
    std::lock_guard<std::mutex> lock(g.mutex());
    states.push_back(g.get_state());
  }
  return states;
}

void set_states(std::vector<at::Generator>& generators, const std::vector<at::Tensor>& states) {
  for (size_t i = 0; i < generators.size() && i < states.size(); ++i) {
    std::lock_guard<std::mutex> lock(generators[i].mutex());
    generators[i].set_state(states[i]);
  }
}

}  // namespace

std::string to_string(WatchFinding finding) {
  switch (finding) {
    case WatchFinding::kGradientBelowNoise:
      return "gradient below noise";
    case WatchFinding::kUnderflow:
      return "underflow";
    case WatchFinding::kOverflow:
      return "overflow";
  }
  TORCH_CHECK(false, "ampx::plan: unknown WatchFinding ", static_cast<int>(finding));
}

std::string WatchEvent::message() const {
  std::ostringstream s;
  s << std::setprecision(3) << "step " << step << ": " << module << " (" << to_string(format)
    << ") " << to_string(finding) << ": ";
  switch (finding) {
    case WatchFinding::kGradientBelowNoise:
      s << "|g| " << gradient_norm << ", its noise " << noise_norm << " (ratio "
        << (noise_norm > 0 ? gradient_norm / noise_norm : 0.0) << ")";
      break;
    case WatchFinding::kUnderflow:
      s << underflow * 100 << "% of the gradient's non-zero values flushed to 0";
      break;
    case WatchFinding::kOverflow:
      s << non_finite * 100 << "% of the gradient inf or NaN (bf16's finite)";
      break;
  }
  if (moved_to != format) s << "; moved to " << to_string(moved_to);
  return s.str();
}

PlanWatch::PlanWatch(torch::nn::Module& model, PrecisionPlan plan, const WatchOptions& options)
    : model_(&model), plan_(std::move(plan)), options_(options) {
  TORCH_CHECK_VALUE(options.every() >= 1, "ampx::plan::PlanWatch: every must be >= 1, got ",
                    options.every());
  TORCH_CHECK_VALUE(options.noise_ratio() > 0 && std::isfinite(options.noise_ratio()),
                    "ampx::plan::PlanWatch: noise_ratio must be > 0, got ", options.noise_ratio());
  TORCH_CHECK_VALUE(options.underflow_fraction() >= 0 && options.underflow_fraction() < 1,
                    "ampx::plan::PlanWatch: underflow_fraction must be in [0, 1), got ",
                    options.underflow_fraction());
  const auto linears = detail::linears_of(model);
  for (const auto& l : plan_.layers) {
    planned_.push_back(l.format);
    auto* linear = detail::find_linear(linears, l.module, "PlanWatch");
    const bool converted = detail::is_wide(l.format)
                               ? fp8::detail::wide_product_of(*linear).has_value()
                               : fp8::scaling_of(*linear) != nullptr;
    TORCH_CHECK_VALUE(l.format == LayerFormat::kBFloat16 || converted,
                      "ampx::plan::PlanWatch: layer '", l.module, "' is planned in ",
                      to_string(l.format), " but is not converted (apply_plan first)");
  }
}

bool PlanWatch::due(int64_t step) const {
  return step >= 0 && step % options_.every() == 0;
}

bool PlanWatch::moved() const {
  for (size_t i = 0; i < plan_.layers.size(); ++i) {
    if (plan_.layers[i].format != planned_[i]) return true;
  }
  return false;
}

void PlanWatch::restore(const std::map<std::string, LayerFormat>& formats) {
  const auto linears = detail::linears_of(*model_);
  std::vector<std::pair<LayerPlan*, LayerFormat>> moves;  // all checked before any is made
  for (const auto& [module, format] : formats) {
    const auto it = std::find_if(plan_.layers.begin(), plan_.layers.end(),
                                 [&](const LayerPlan& l) { return l.module == module; });
    TORCH_CHECK_VALUE(it != plan_.layers.end(), "ampx::plan::PlanWatch::restore: module '",
                      module, "' is not in the watched plan");
    LayerFormat reachable = it->format;
    while (reachable != format) {
      const LayerFormat wider = wider_format(reachable, plan_.target);
      TORCH_CHECK_VALUE(wider != reachable, "ampx::plan::PlanWatch::restore: layer '", module,
                        "' is in ", to_string(it->format), ", which the watch does not widen to ",
                        to_string(format), " on ", plan_.target);
      reachable = wider;
    }
    if (format != it->format) moves.emplace_back(&*it, format);
  }
  for (const auto& [layer, format] : moves) {
    move(*layer, *detail::find_linear(linears, layer->module, "PlanWatch::restore"), format);
    layer->reason = "moved by the watch before the checkpoint this run resumed";
  }
}

void PlanWatch::move(LayerPlan& layer, torch::nn::LinearImpl& linear, LayerFormat to) {
  if (detail::is_wide(to)) {
    detail::convert_layers(*model_, {layer.module}, to, 0);
  } else {
    // A moved layer's new scaling is not registered as buffers (checkpoints
    // keep its first format's): fine while every format a move reaches
    // keeps no state between steps, as recipe_of's current and block
    // recipes do; a delayed-scaling target would resume differently.
    TORCH_INTERNAL_ASSERT(to == LayerFormat::kBFloat16 || !recipe_of(to).is_delayed(),
                          "ampx::plan: a watch move to a stateful recipe");
    fp8::reconvert_linear(linear, to == LayerFormat::kBFloat16
                                      ? c10::optional<fp8::Recipe>()
                                      : c10::optional<fp8::Recipe>(recipe_of(to)));
  }
  layer.format = to;
  layer.scale_rule = scale_rule_of(to);
}

void PlanWatch::begin_step(int64_t step) {
  if (!due(step)) return;
  auto generators = generators_of(*model_);
  begun_state_ = states_of(generators);
  begun_ = step;
}

std::vector<WatchEvent> PlanWatch::check(int64_t step, const std::function<void()>& backward) {
  const auto linears = detail::linears_of(*model_);
  std::vector<std::pair<LayerPlan*, torch::nn::LinearImpl*>> watched;
  std::vector<at::Tensor> in_format;
  for (auto& l : plan_.layers) {
    // bf16 is what the layer is compared with, fp32 wider still.
    if (l.format == LayerFormat::kBFloat16 || l.format == LayerFormat::kFloat32) continue;
    auto* linear = detail::find_linear(linears, l.module, "PlanWatch::check");
    TORCH_CHECK(linear->weight.grad().defined(), "ampx::plan::PlanWatch::check: layer '", l.module,
                "' has no weight gradient at step ", step,
                " (check after the backward, before the optimizer's step and zero_grad)");
    watched.emplace_back(&l, linear);
    in_format.push_back(linear->weight.grad());  // take_grads() keeps it from the backward
  }
  if (watched.empty()) return {};

  // The same batch with every Linear in bf16, leaving no trace: gradients,
  // buffers (a BatchNorm's running statistics) and generators put back.
  const auto grads = take_grads(*model_);
  std::vector<at::Tensor> buffers;
  for (const auto& b : model_->buffers()) buffers.push_back(b.detach().clone());
  auto generators = generators_of(*model_);
  const auto after_step = states_of(generators);
  const auto restore = [&] {
    put_grads(*model_, grads);
    torch::NoGradGuard no_grad;
    auto now = model_->buffers();
    for (size_t i = 0; i < now.size(); ++i) now[i].copy_(buffers[i]);
    set_states(generators, after_step);
  };
  if (begun_ == step) set_states(generators, begun_state_);  // the step's dropout masks
  std::vector<at::Tensor> bf16;
  try {
    {
      fp8::Fp8AutocastGuard off(false);
      backward();
    }
    for (const auto& [l, linear] : watched) {
      TORCH_CHECK(linear->weight.grad().defined(), "ampx::plan::PlanWatch::check: the backward ",
                  "gave layer '", l->module, "' no weight gradient at step ", step);
      bf16.push_back(linear->weight.grad());  // restore() detaches it from the layer
    }
  } catch (...) {
    restore();
    throw;
  }
  restore();

  std::vector<Decision> decisions;
  for (size_t i = 0; i < watched.size(); ++i) {
    Decision d;
    d.numbers = compare(in_format[i], bf16[i]);
    d.finding = worst_finding(d.numbers, options_);
    const LayerFormat format = watched[i].first->format;
    d.moved_to = d.finding && options_.widen() ? wider_format(format, plan_.target) : format;
    decisions.push_back(d);
  }
  if (options_.group()) agree_on_rank0s(*options_.group(), decisions);

  std::vector<WatchEvent> events;
  for (size_t i = 0; i < watched.size(); ++i) {
    LayerPlan& l = *watched[i].first;
    const Decision& d = decisions[i];
    if (!d.finding) continue;
    WatchEvent e = event_of(step, l, d);
    if (e.moved_to != l.format) {
      move(l, *watched[i].second, e.moved_to);
      l.reason = "moved by the watch at step " + std::to_string(step) + " (" +
                 to_string(e.finding) + " in " + to_string(e.format) + ")";
    }
    events.push_back(e);
  }
  events_.insert(events_.end(), events.begin(), events.end());
  return events;
}

}  // namespace plan
}  // namespace ampx
