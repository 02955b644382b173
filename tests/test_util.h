#pragma once

// Helpers shared by ampx's tests.

#include "ampx/autocast.h"
#include "ampx/detail/compat.h"
#include "ampx/optim.h"

#include "error_text.h"

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace ampx {
namespace test {

inline constexpr float kInf = std::numeric_limits<float>::infinity();

/// Whether this LibTorch has float16 CPU autocast (2.x does, 1.13 not).
inline bool cpu_fp16_autocast() {
  try {
    ampx::AutocastGuard g(torch::kCPU, torch::kHalf);
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

/// Collects the TORCH_WARN messages of its scope (this thread).
class WarningCapture : public c10::WarningHandler {
 public:
  WarningCapture() : guard_(this) {}
#if AMPX_TORCH_AT_LEAST(2, 0)
  void process(const c10::Warning& warning) override {
    messages.push_back(warning.msg());
  }
#else
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override {
    messages.push_back(msg);
  }
#endif
  std::vector<std::string> messages;

 private:
#if AMPX_TORCH_AT_LEAST(2, 0)
  c10::WarningUtils::WarningHandlerGuard guard_;
#else
  c10::Warning::WarningHandlerGuard guard_;  // Warning was a namespace in 1.13
#endif
};

/// A float32's bit pattern, and back.
inline uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// Directory holding the files tests/reference/torch_reference.py wrote
/// (ctest sets AMPX_REFERENCE_DIR; the fixture test generates them).
inline std::string reference_dir() {
  const char* dir = std::getenv("AMPX_REFERENCE_DIR");
  return dir ? dir : AMPX_DEFAULT_REFERENCE_DIR;
}

/// Loads a reference JSON file; a missing file fails the test, it never skips.
inline nlohmann::json load_reference(const std::string& name) {
  const std::string path = reference_dir() + "/" + name;
  std::ifstream in(path);
  if (!in) {
    ADD_FAILURE() << "reference file " << path
                  << " is missing: run tests/reference/torch_reference.py generate "
                  << reference_dir();
    return nlohmann::json();
  }
  return nlohmann::json::parse(in);
}

/// The small MLP of the GradScaler and optimizer tests: 8 -> hidden -> 1.
/// With `float_output` the input is cast to the weights' dtype and the output
/// to float32 (for models whose parameters were cast to bf16/fp16 by hand);
/// without, it computes in whatever autocast gives.
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t hidden = 16, bool float_output = false) : float_output_(float_output) {
    fc1 = register_module("fc1", torch::nn::Linear(8, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    if (!float_output_) return fc2(torch::relu(fc1(x)));
    return fc2(torch::relu(fc1(x.to(fc1->weight.scalar_type())))).to(torch::kFloat);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};

 private:
  bool float_output_;
};
TORCH_MODULE(Mlp);

/// A regression batch: x [n, 8] fp32 from `seed`, y = sin(sum(x)) [n, 1].
struct Batch {
  torch::Tensor x, y;
};

inline Batch make_batch(int64_t seed, int64_t n = 32) {
  auto g = at::detail::createCPUGenerator(seed);
  auto x = at::randn({n, 8}, g);
  return {x, x.sum(1, true).sin()};
}

/// Detached copies (undefined tensors stay undefined).
inline std::vector<torch::Tensor> snapshot(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(t.defined() ? t.detach().clone() : t);
  return out;
}

/// Copies of a module's parameters.
inline std::vector<torch::Tensor> snapshot(const torch::nn::Module& m) {
  return snapshot(m.parameters());
}

/// Same dtypes, shapes and bits (and the same undefined entries).
inline bool same_bits(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined()) return false;
    if (a[i].defined() && !torch::equal(a[i], b[i])) return false;
  }
  return true;
}

inline void copy_params(const torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  const auto src = from.parameters();
  auto dst = to.parameters();
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
}

/// The bytes `opt.save()` writes: every piece of state it would resume from
/// (moments, step counts, fp32 masters of ampx::optim optimizers).
inline std::string save_to_string(const torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive out;
  opt.save(out);
  std::ostringstream ss;
  out.save_to(ss);
  return ss.str();
}

/// Loads into `opt` what save_to_string() gave.
inline void load_from_string(torch::optim::Optimizer& opt, const std::string& bytes) {
  std::istringstream ss(bytes);
  torch::serialize::InputArchive in;
  in.load_from(ss);
  opt.load(in);
}

/// torch::optim's key of a parameter's state: its TensorImpl's address,
/// printed (LibTorch 1.13) or as a pointer (2.x).
template <class Key>
Key optimizer_state_key(const torch::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;
    os << p.unsafeGetTensorImpl();
    return os.str();
  } else {
    return p.unsafeGetTensorImpl();
  }
}

/// Every tensor an optimizer holds per parameter, in parameter order: fp32
/// masters, Kahan compensations, moments (decoded to fp32) and step counts
/// of ampx::optim optimizers; moments and
/// step counts of torch::optim's Adam/AdamW, SGD's momentum buffers.
/// (Compared tensor by tensor: saved archives are zip files whose bytes
/// need not repeat.) A parameter without state adds an undefined tensor.
inline std::vector<torch::Tensor> optimizer_tensors(const torch::optim::Optimizer& opt) {
  using Key = typename std::decay_t<decltype(opt.state())>::key_type;
  std::vector<torch::Tensor> out;
  auto add = [&](const torch::Tensor& t) { out.push_back(t.defined() ? t.clone() : t); };
  if (const auto* mp = dynamic_cast<const ampx::optim::MixedPrecisionOptimizer*>(&opt)) {
    for (const auto& group : mp->param_groups()) {
      for (const auto& p : group.params()) {
        add(mp->master(p));
        add(mp->compensation(p));
        add(mp->exp_avg(p));
        add(mp->exp_avg_sq(p));
        out.push_back(torch::tensor(mp->step_count(p)));
      }
    }
    return out;
  }
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = opt.state().find(optimizer_state_key<Key>(p));
      if (it == opt.state().end()) {
        out.emplace_back();
        continue;
      }
      const auto* state = it->second.get();
      if (const auto* s = dynamic_cast<const torch::optim::AdamParamState*>(state)) {
        add(s->exp_avg());
        add(s->exp_avg_sq());
        add(s->max_exp_avg_sq());
        out.push_back(torch::tensor(s->step()));
      } else if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state)) {
        add(s->exp_avg());
        add(s->exp_avg_sq());
        add(s->max_exp_avg_sq());
        out.push_back(torch::tensor(s->step()));
      } else if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(state)) {
        add(s->momentum_buffer());
      } else {
        ADD_FAILURE() << "optimizer_tensors: unknown optimizer state type";
      }
    }
  }
  return out;
}

/// An optimizer's params and every tensor it holds for them (optimizer_tensors),
/// for "unchanged" and "bitwise equal" checks.
inline std::vector<torch::Tensor> full_state(const torch::optim::Optimizer& opt) {
  std::vector<torch::Tensor> out;
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : snapshot(group.params())) out.push_back(p);
  }
  for (const auto& t : optimizer_tensors(opt)) out.push_back(t);
  return out;
}

/// All that a training step may change: parameters, module buffers (e.g.
/// BatchNorm running stats) and the optimizers' state.
struct TrainingState {
  std::vector<torch::Tensor> params, buffers;
  std::vector<std::vector<torch::Tensor>> optimizers;
};

inline TrainingState training_state(const torch::nn::Module& m,
                                    std::vector<const torch::optim::Optimizer*> opts) {
  TrainingState s{snapshot(m.parameters()), snapshot(m.buffers()), {}};
  for (const auto* opt : opts) s.optimizers.push_back(optimizer_tensors(*opt));
  return s;
}

/// A skipped step leaves everything bitwise as it was.
inline void expect_unchanged(const TrainingState& before, const TrainingState& after) {
  EXPECT_TRUE(same_bits(before.params, after.params)) << "parameters changed";
  EXPECT_TRUE(same_bits(before.buffers, after.buffers)) << "module buffers changed";
  ASSERT_EQ(before.optimizers.size(), after.optimizers.size());
  for (size_t i = 0; i < before.optimizers.size(); ++i) {
    EXPECT_TRUE(same_bits(before.optimizers[i], after.optimizers[i]))
        << "the state of optimizer " << i << " changed";
  }
}

/// Makes the first element of `m`'s first parameter's gradient `value`
/// (an inf or NaN a GradScaler must find).
inline void poison_grad(torch::nn::Module& m, float value = kInf) {
  auto g = m.parameters()[0].mutable_grad();
  g.view(-1)[0] = value;
}

/// `values` in a view that steps 2 along its last dimension (a non-contiguous
/// leaf): optimizers take ATen's per-tensor path for it, not the fused kernels.
inline at::Tensor strided_copy(const at::Tensor& values) {
  auto wide = values.sizes().vec();
  wide.back() *= 2;
  auto view = at::zeros(wide, values.options()).slice(-1, 0, wide.back(), 2);
  view.copy_(values);
  return view;
}

}  // namespace test
}  // namespace ampx
