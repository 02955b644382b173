// ampx::checkpoint: a custom autograd function whose forward runs the user's
// function without a graph and whose backward runs it again, in the regions
// and with the random state of the forward, and backpropagates through what
// it made (a backward inside backward: PyTorch's reentrant checkpoint).

#include "ampx/checkpoint.h"

#include "ampx/amp.h"
#include "ampx/autocast.h"
#include "ampx/fp8/autocast.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>

#include <array>
#include <mutex>
#include <set>
#include <string>
#include <utility>

namespace ampx {
namespace {

constexpr std::array<c10::DeviceType, 2> kAutocastDevices{c10::DeviceType::CPU,
                                                          c10::DeviceType::CUDA};

// A thread's autocast state on one device, as AutocastGuard sets it.
struct AutocastState {
  bool enabled;
  c10::ScalarType dtype;
  bool cache_enabled;
  bool operator==(const AutocastState& o) const {
    return enabled == o.enabled && dtype == o.dtype && cache_enabled == o.cache_enabled;
  }
};

AutocastState autocast_state(c10::DeviceType device_type) {
  return {is_autocast_enabled(device_type), get_autocast_dtype(device_type),
          is_autocast_cache_enabled()};
}

// What the forward ran with, kept for the recompute.
struct CheckpointState : torch::CustomClassHolder {
  CheckpointFunction fn;
  CheckpointOptions options;
  std::vector<bool> requires_grad;  // per input
  std::shared_ptr<const AmpProperties> forward_region;
  std::array<AutocastState, kAutocastDevices.size()> autocast;
  at::Tensor cpu_rng;
  std::vector<std::pair<c10::Device, at::Tensor>> cuda_rng;  // per CUDA device of an input
};

at::Tensor generator_state(const at::Generator& generator) {
  at::Generator g = generator;
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

void set_generator_state(const at::Generator& generator, const at::Tensor& state) {
  at::Generator g = generator;
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

// Sets the generators to their state at the forward; puts back on exit what
// they had (also by exception).
class RngFork {
 public:
  explicit RngFork(const CheckpointState& s) : s_(s) {
    if (!s_.options.preserve_rng_state()) return;
    const auto& cpu = at::detail::getDefaultCPUGenerator();
    cpu_ = generator_state(cpu);
    for (const auto& [device, state] : s_.cuda_rng) {
      const auto& g = at::globalContext().defaultGenerator(device);
      cuda_.push_back(generator_state(g));
      set_generator_state(g, state);
    }
    set_generator_state(cpu, s_.cpu_rng);
  }
  ~RngFork() {
    if (!s_.options.preserve_rng_state()) return;
    set_generator_state(at::detail::getDefaultCPUGenerator(), cpu_);
    for (size_t i = 0; i < cuda_.size(); ++i) {
      set_generator_state(at::globalContext().defaultGenerator(s_.cuda_rng[i].first), cuda_[i]);
    }
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  const CheckpointState& s_;
  at::Tensor cpu_;
  std::vector<at::Tensor> cuda_;
};

// Autocast's weight-cast cache off while it lives. The forward runs without
// a graph, so its casts of fp32 weights have none either: kept in the cache,
// they would stand in for the weight in a later use in the same region,
// which would then give the weight no gradient.
class NoAutocastCache {
 public:
  NoAutocastCache() : was_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~NoAutocastCache() { at::autocast::set_autocast_cache_enabled(was_); }
  NoAutocastCache(const NoAutocastCache&) = delete;
  NoAutocastCache& operator=(const NoAutocastCache&) = delete;

 private:
  bool was_;
};

std::vector<at::Tensor> run_checked(const CheckpointState& s, const std::vector<at::Tensor>& in) {
  auto out = s.fn(in);
  for (size_t i = 0; i < out.size(); ++i) {
    TORCH_CHECK_VALUE(out[i].defined(), "ampx::checkpoint: the function's output ", i,
                      " is an undefined tensor; every output must be defined");
  }
  return out;
}

struct CheckpointNode : torch::autograd::Function<CheckpointNode> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs,
                                                const c10::intrusive_ptr<CheckpointState>& s) {
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["state"] = c10::IValue::make_capsule(s);
    NoAutocastCache no_cache;
    return run_checked(*s, inputs.vec());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
                "ampx::checkpoint: its gradients are accumulated by a backward inside backward, "
                "so it works with backward() but not with torch::autograd::grad() or "
                "backward(inputs=...)");
    const auto s =
        c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      inputs[i] = saved[i].detach();
      if (s->requires_grad[i]) inputs[i].requires_grad_(true);
    }
    std::vector<at::Tensor> outputs;
    {
      RngFork rng(*s);
      std::shared_ptr<ForwardGuard> forward_region;
      if (s->forward_region) forward_region = detail::enter_forward_region(*s->forward_region);
      std::vector<std::unique_ptr<AutocastGuard>> autocast;
      for (size_t d = 0; d < kAutocastDevices.size(); ++d) {
        const auto& want = s->autocast[d];
        if (autocast_state(kAutocastDevices[d]) == want) continue;
        autocast.push_back(std::make_unique<AutocastGuard>(kAutocastDevices[d], want.dtype,
                                                           want.enabled, want.cache_enabled));
      }
      std::shared_ptr<void> user_region;
      if (s->options.recompute_region()) user_region = s->options.recompute_region()();
      c10::AutoGradMode grad(true);
      outputs = run_checked(*s, inputs);
    }
    TORCH_CHECK(outputs.size() == grad_outputs.size(), "ampx::checkpoint: the function returned ",
                outputs.size(), " outputs in backward's recompute and ", grad_outputs.size(),
                " in the forward; it must compute the same thing both times");
    std::vector<at::Tensor> roots, grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    torch::autograd::variable_list result(inputs.size() + 1);  // + the state (no gradient)
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (s->requires_grad[i]) result[i] = inputs[i].grad();
    }
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint(const CheckpointFunction& fn,
                                   const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options) {
  TORCH_CHECK_VALUE(static_cast<bool>(fn), "ampx::checkpoint: fn is empty");
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK_VALUE(inputs[i].defined(), "ampx::checkpoint: input ", i,
                      " is an undefined tensor; every input must be defined");
  }
  if (!at::GradMode::is_enabled()) return fn(inputs);  // no graph: nothing to keep
  TORCH_CHECK(!fp8::is_fp8_enabled(),
              "ampx::checkpoint: refused inside an FP8 region (Fp8AutocastGuard): its "
              "recompute in backward would record each FP8 layer's amax a second time");
  auto s = c10::make_intrusive<CheckpointState>();
  s->fn = fn;
  s->options = options;
  bool any_requires_grad = false;
  for (const auto& t : inputs) {
    s->requires_grad.push_back(t.requires_grad());
    any_requires_grad = any_requires_grad || t.requires_grad();
  }
  if (!any_requires_grad) {
    TORCH_WARN_ONCE(
        "ampx::checkpoint: no input requires grad, so the outputs will not either and the "
        "function's parameters get no gradient");
  }
  s->forward_region = detail::current_forward_region();
  for (size_t d = 0; d < kAutocastDevices.size(); ++d) {
    s->autocast[d] = autocast_state(kAutocastDevices[d]);
  }
  if (options.preserve_rng_state()) {
    s->cpu_rng = generator_state(at::detail::getDefaultCPUGenerator());
    std::set<c10::DeviceIndex> cuda;
    for (const auto& t : inputs) {
      if (t.is_cuda()) cuda.insert(t.get_device());
    }
    for (auto index : cuda) {
      const c10::Device device(c10::kCUDA, index);
      s->cuda_rng.emplace_back(device,
                               generator_state(at::globalContext().defaultGenerator(device)));
    }
  }
  // A TensorList, not a vector: the inputs become the node's edges.
  return CheckpointNode::apply(at::TensorList(inputs), s);
}

at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input, const CheckpointOptions& options) {
  TORCH_CHECK_VALUE(static_cast<bool>(fn), "ampx::checkpoint: fn is empty");
  return checkpoint(
      [fn](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in[0])}; },
      {input}, options)[0];
}

}  // namespace ampx
