#pragma once

// What tests/plan's suites share: a small MLP of four Linears, a random
// teacher's labels to learn, the model trained and measured once for all
// of them, and the user's own loop to compare plans with.

#include "ampx/autocast.h"
#include "ampx/fp8/autocast.h"
#include "ampx/precision_plan.h"

#include <torch/torch.h>

#include <unistd.h>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ampx {
namespace plan_test {

using plan::LayerFormat;

// Four Linears, all multiples of 16 (every format applies).
struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(32, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 64))),
        fc3(register_module("fc3", torch::nn::Linear(64, 64))),
        head(register_module("head", torch::nn::Linear(64, 16))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::gelu(fc1->forward(x));
    h = torch::gelu(fc2->forward(h));
    h = torch::gelu(fc3->forward(h));
    return head->forward(h).to(torch::kFloat);
  }
  torch::nn::Linear fc1, fc2, fc3, head;
};

TORCH_MODULE(Mlp);

// Batches of 64 rows (NVFP4's Hadamard transform takes multiples of 16),
// labels from a fixed random teacher: a real learning problem.
class TeacherData {
 public:
  explicit TeacherData(int64_t batches) {
    torch::manual_seed(1234);
    const auto w1 = torch::randn({32, 48});
    const auto w2 = torch::randn({48, 16});
    for (int64_t i = 0; i < batches; ++i) {
      inputs_.push_back(torch::randn({64, 32}));
      targets_.push_back(torch::tanh(inputs_.back().mm(w1)).mm(w2).argmax(1));
    }
  }
  torch::Tensor loss(torch::nn::Module& model, int64_t step) const {
    auto& mlp = dynamic_cast<MlpImpl&>(model);
    const auto i = static_cast<size_t>(step) % inputs_.size();
    return torch::cross_entropy_loss(mlp.forward(inputs_[i]), targets_[i]);
  }

 private:
  std::vector<torch::Tensor> inputs_, targets_;
};

inline plan::MeasureProblem problem_of(const TeacherData& data) {
  plan::MeasureProblem p;
  p.make_model = [] { return Mlp().ptr(); };
  p.loss = [&data](torch::nn::Module& m, int64_t step) { return data.loss(m, step); };
  return p;
}

inline plan::MeasureOptions measure_options() {
  return plan::MeasureOptions().steps(6).eval_batches(4).lr(3e-3).seed(7).tokens_per_step(64);
}

inline const plan::FormatMeasurement& measured(const plan::LayerMeasurement& layer, LayerFormat f) {
  for (const auto& m : layer.formats) {
    if (m.format == f) return m;
  }
  throw std::runtime_error("format not measured: " + plan::to_string(f));
}

// The model every training test measures: fresh weights from seed 0, then
// trained 20 bf16 steps (the plan is made from a model in training).
inline Mlp trained_model(const TeacherData& data) {
  torch::manual_seed(0);
  Mlp model;
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3));
  for (int64_t step = 0; step < 20; ++step) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      loss = data.loss(*model, 100 + step);
    }
    loss.backward();
    opt.step();
  }
  return model;
}

struct Measured {
  TeacherData data{128};
  Mlp model = trained_model(data);
  plan::Measurement m = plan::measure_layers(*model, problem_of(data), measure_options());
};

// Measured once for the tests below (the first checks it is deterministic).
inline Measured& measured_mlp() {
  static Measured* const m = new Measured();
  return *m;
}

// What the user's own loop gives from the measured model's weights: 6 AdamW
// steps on batches 0..5, then the mean loss of batches 6..9, under bf16
// autocast or in float32.
inline double users_loop(Measured& fx, bool bf16_autocast) {
  Mlp copy;
  {
    torch::NoGradGuard no_grad;
    const auto source = fx.model->named_parameters();
    for (auto& p : copy->named_parameters()) p.value().copy_(source[p.key()]);
  }
  torch::optim::AdamW opt(copy->parameters(), torch::optim::AdamWOptions(3e-3));
  for (int64_t step = 0; step < 6; ++step) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      AutocastGuard autocast(torch::kCPU, torch::kBFloat16, bf16_autocast);
      loss = fx.data.loss(*copy, step);
    }
    loss.backward();
    opt.step();
  }
  torch::NoGradGuard no_grad;
  AutocastGuard autocast(torch::kCPU, torch::kBFloat16, bf16_autocast);
  double eval = 0;
  for (int64_t e = 0; e < 4; ++e) eval += fx.data.loss(*copy, 6 + e).item<double>();
  return eval / 4;
}

// The budget the training tests plan for: 0.3% of the loss.
inline constexpr double kBudget = 0.003;

inline bool has_format(const plan::PrecisionPlan& p, LayerFormat f) {
  return std::any_of(p.layers.begin(), p.layers.end(),
                     [f](const plan::LayerPlan& l) { return l.format == f; });
}

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream(p) << text;
}

struct TempFolder {
  std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("ampx-plan-" + std::to_string(::getpid()));
  TempFolder() { std::filesystem::create_directories(path); }
  ~TempFolder() { std::filesystem::remove_all(path); }
};

// `steps` AdamW steps of `model` from `from`'s weights on batches 0.., each
// under bf16 autocast inside an FP8 region (as ampx-train runs a plan);
// `between(step)` runs before each. Returns the losses.
inline std::vector<double> train_planned(Mlp& model, Measured& from, int64_t steps,
                                         const std::function<void(int64_t)>& between) {
  {
    torch::NoGradGuard no_grad;
    const auto source = from.model->named_parameters();
    for (auto& p : model->named_parameters()) p.value().copy_(source[p.key()]);
  }
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3));
  std::vector<double> losses;
  for (int64_t step = 0; step < steps; ++step) {
    between(step);
    opt.zero_grad();
    torch::Tensor loss;
    {
      AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      fp8::Fp8AutocastGuard region;
      loss = from.data.loss(*model, step);
    }
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

// A layer measured by hand: `share` of the Linear FLOPs, a loss change per format.
inline plan::LayerMeasurement layer_of(const std::string& module, double share,
                                       std::vector<plan::FormatMeasurement> formats) {
  plan::LayerMeasurement layer;
  layer.module = module;
  layer.in_features = 64;
  layer.out_features = 64;
  layer.flops_share = share;
  layer.formats = std::move(formats);
  return layer;
}

}  // namespace plan_test
}  // namespace ampx
