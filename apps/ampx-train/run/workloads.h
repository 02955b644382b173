#pragma once

// The four workloads of ampx-train (gpt, gpt-nn, mnist-cnn, fashion-mlp),
// each a model + its data + its loss and held-out metric. Batches are a pure
// function of (seed, step), so a resumed run sees exactly the batches an
// uninterrupted one would.
//
//   auto w = make_workload(config);            // loads the data once
//   torch::nn::AnyModule model = w->build(device);  // fresh weights (torch's global seed)
//   Batch b = w->batch(step, device);          // input, target, step
//   auto loss = w->loss(model.forward(b.input), b.target);

#include "cli/config.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <string>

namespace ampx::train {

struct Batch {
  torch::Tensor input;   // gpt: int64 [B, T]; images: fp32 [B, 1, 28, 28] or [B, 784]
  torch::Tensor target;  // gpt: int64 [B, T]; images: int64 [B]
  int64_t step = -1;     // the training step it is for (diagnostics quote it)
};

struct EvalResult {
  double loss = 0;    // mean cross entropy on the held-out split (nats)
  double metric = 0;  // gpt: bits per character; images: accuracy in %
};

class Workload {
 public:
  virtual ~Workload() = default;
  virtual std::string name() const = 0;
  /// "tokens" or "samples": what throughput counts.
  virtual std::string unit() const = 0;
  /// The held-out metric as the metrics and JSON files name it: "bpc" or
  /// "accuracy".
  virtual std::string metric_name() const = 0;
  /// Whether the metric is a percentage (accuracy) rather than a value (bpc).
  virtual bool metric_is_percent() const = 0;
  /// `value` as a reader expects it: "bpc 2.345" or "accuracy 42.68%".
  std::string describe_metric(double value) const;
  virtual int64_t items_per_step() const = 0;
  virtual int64_t steps_per_epoch() const = 0;
  /// The settings a checkpoint must share with the run resuming it.
  virtual nlohmann::json identity() const = 0;
  /// A freshly initialised model on `device`, from torch's global seed: its
  /// module (`.ptr()`) and its forward (`.forward(input)`).
  virtual torch::nn::AnyModule build(const torch::Device& device) = 0;
  /// The submodules of `model` (build()'s) its forward calls through
  /// ampx::dist::sharded_forward: --shard full gathers each on its own, the
  /// rest of the model as one more unit. None: the whole model is one.
  virtual std::vector<std::shared_ptr<torch::nn::Module>> units(torch::nn::Module& model) const {
    (void)model;
    return {};
  }
  /// Step `step`'s batch on `device` (deterministic in the seed and step).
  virtual Batch batch(int64_t step, const torch::Device& device) = 0;
  /// Mean cross entropy, computed in fp32 whatever the output dtype.
  virtual torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) = 0;
  /// Held-out loss and metric. `forward` runs the model as the mode does
  /// (autocast or cast inputs); it is called under NoGradGuard in eval mode.
  virtual EvalResult evaluate(const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                              const torch::Device& device) = 0;
};

/// Loads the workload's data from config.data_dir (errors name the install
/// command when it is missing) and sizes the model from `config`.
std::unique_ptr<Workload> make_workload(const TrainConfig& config);

}  // namespace ampx::train
