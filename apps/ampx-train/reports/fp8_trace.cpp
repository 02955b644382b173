#include "fp8_trace.h"

#include "cli/shell.h"
#include "output_file.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <sstream>

namespace ampx::train {

namespace fs = std::filesystem;

Fp8Trace::Fp8Trace(const std::string& layer, torch::nn::Module& model,
                   const std::vector<std::string>& layers) {
  layer_ = layer.empty() ? layers.front() : layer;
  std::string known;
  for (const auto& l : layers) known += (known.empty() ? "" : ", ") + l;
  TORCH_CHECK(std::find(layers.begin(), layers.end(), layer_) != layers.end(),
              "ampx-train: --fp8-trace-layer '", layer_, "' is not an FP8 layer of this model (",
              known, ")");
  scaling_ = ampx::fp8::scaling_of(*model.named_modules()[layer_]);
}

void Fp8Trace::add(int64_t step, nlohmann::ordered_json& record) {
  const ampx::fp8::TensorScaling* roles[] = {scaling_->input.get(), scaling_->weight.get(),
                                             scaling_->grad_output.get()};
  static const char* names[] = {"input", "weight", "grad_output"};
  std::array<double, 6> row{};
  for (int i = 0; i < 3; ++i) {
    row[2 * i] = roles[i]->last_amax().item<double>();
    row[2 * i + 1] = roles[i]->scale().item<double>();
    record[std::string("fp8_") + names[i] + "_amax"] = row[2 * i];
    record[std::string("fp8_") + names[i] + "_scale"] = row[2 * i + 1];
  }
  record["fp8_layer"] = layer_;
  rows_.emplace_back(step, row);
}

std::string Fp8Trace::write(const std::string& dir, const std::string& mode) const {
  const fs::path data = fs::path(dir) / ("fp8-trace-" + mode + ".dat");
  std::ostringstream rows;
  rows << "# " << layer_ << ": step input_amax input_scale weight_amax weight_scale "
       << "grad_output_amax grad_output_scale (scale: the next step's)\n";
  for (const auto& [step, r] : rows_) {
    rows << step + 1;
    for (double v : r) rows << " " << v;
    rows << "\n";
  }
  write_output_file(data, rows.str());
  const std::string png = "fp8-trace-" + mode + ".png";
  const std::string script = "fp8-trace-" + mode + ".gp";
  const std::string d = data.filename().string();
  std::ostringstream gp;
  gp << "set terminal pngcairo size 1400,520 font ',11'\nset output '" << png << "'\n"
     << "set multiplot layout 1,2 title 'FP8 scaling of " << layer_ << "'\n"
     << "set grid\nset logscale y\nset key bottom right\nset xlabel 'step'\n"
     << "set offsets 0, 0, graph 0.08, graph 0.08\n"
     << "set title 'amax (after the step)'\n"
     << "plot '" << d << "' using 1:2 with lines title 'input', '' using 1:4 with lines "
     << "title 'weight', '' using 1:6 with lines title 'output gradient'\n"
     << "set title 'scale'\n"
     << "plot '" << d << "' using 1:3 with lines title 'input (E4M3)', '' using 1:5 with "
     << "lines title 'weight (E4M3)', '' using 1:7 with lines title 'output gradient'\n"
     << "unset multiplot\n";
  write_output_file(fs::path(dir) / script, gp.str());
  std::string note;
  const std::string plot = run_gnuplot(dir, script, png, note);
  return plot.empty() ? data.string() : plot;
}

}  // namespace ampx::train
