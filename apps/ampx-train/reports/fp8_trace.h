#pragma once

// Mode fp8's trace of one layer's scaling: after every step, the amaxes and
// scales of its three casts (input, weight, output gradient), into that
// step's metrics record and, at the end, a data file and a plot.
//
//   Fp8Trace trace(config.fp8_trace_layer, model, setup.fp8_layers);  // checks the layer
//   trace.add(step, record);                  // fp8_input_amax, fp8_input_scale, ...
//   result.fp8_trace_path = trace.write(config.out_dir, "fp8");  // the PNG, or the data

#include <ampx/fp8/linear.h>

#include <torch/nn/module.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ampx::train {

class Fp8Trace {
 public:
  /// Traces `layer` ("" : the first of `layers`, the model's FP8 layers by
  /// path); errors name the layer and list those there are.
  Fp8Trace(const std::string& layer, torch::nn::Module& model,
           const std::vector<std::string>& layers);

  /// Adds the layer's amaxes and scales after step `step` to `record`.
  void add(int64_t step, nlohmann::ordered_json& record);

  /// Writes fp8-trace-<mode>.dat and .gp in `dir` (each whole or not at
  /// all) and runs gnuplot; returns the PNG's path if gnuplot made it, else
  /// the data's.
  std::string write(const std::string& dir, const std::string& mode) const;

 private:
  std::string layer_;
  std::shared_ptr<ampx::fp8::LinearScaling> scaling_;
  std::vector<std::pair<int64_t, std::array<double, 6>>> rows_;
};

}  // namespace ampx::train
