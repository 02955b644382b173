// Layer formats, their recipes, and the cost models of the targets.

#include "ampx/precision_plan.h"

#include "ampx/autocast.h"
#include "ampx/fp8/linear.h"
#include "linears.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>

namespace ampx {
namespace plan {
namespace {

struct FormatName {
  LayerFormat format;
  const char* name;
};
// Widest first: the order ties are broken in.
constexpr FormatName kFormats[] = {
    {LayerFormat::kFloat32, "fp32"},  {LayerFormat::kFloat16, "fp16"},
    {LayerFormat::kBFloat16, "bf16"}, {LayerFormat::kFp8Block, "fp8-block"},
    {LayerFormat::kFp8, "fp8"},       {LayerFormat::kMxfp8, "mxfp8"},
    {LayerFormat::kNvfp4, "nvfp4"},
};

}  // namespace

std::string to_string(LayerFormat format) {
  for (const auto& f : kFormats) {
    if (f.format == format) return f.name;
  }
  TORCH_CHECK(false, "ampx::plan: unknown LayerFormat ", static_cast<int>(format));
}

LayerFormat parse_layer_format(const std::string& name, const std::string& what) {
  std::string known;
  for (const auto& f : kFormats) {
    if (name == f.name) return f.format;
    known += (known.empty() ? "" : ", ") + std::string(f.name);
  }
  TORCH_CHECK_VALUE(false, "ampx::plan: ", what, " '", name, "' is not a layer format (", known,
                    ")");
}

std::vector<LayerFormat> all_layer_formats() {
  std::vector<LayerFormat> all;
  for (const auto& f : kFormats) all.push_back(f.format);
  return all;
}

int element_bits(LayerFormat format) {
  switch (format) {
    case LayerFormat::kFloat32:
      return 32;
    case LayerFormat::kFloat16:
    case LayerFormat::kBFloat16:
      return 16;
    case LayerFormat::kFp8:
    case LayerFormat::kFp8Block:
    case LayerFormat::kMxfp8:
      return 8;
    case LayerFormat::kNvfp4:
      return 4;
  }
  TORCH_CHECK(false, "ampx::plan: unknown LayerFormat ", static_cast<int>(format));
}

fp8::Recipe recipe_of(LayerFormat format, uint64_t seed) {
  switch (format) {
    case LayerFormat::kFp8:
      return fp8::CurrentScaling();  // HYBRID: E4M3 forward, E5M2 gradients
    case LayerFormat::kMxfp8:
      return fp8::MXFP8BlockScaling();
    case LayerFormat::kNvfp4:
      return fp8::NVFP4BlockScaling().seed(seed);
    case LayerFormat::kFp8Block:
      return fp8::Float8BlockScaling();
    case LayerFormat::kBFloat16:
    case LayerFormat::kFloat16:
    case LayerFormat::kFloat32:
      break;
  }
  TORCH_CHECK_VALUE(false, "ampx::plan: format ", to_string(format),
                    " has no FP8 recipe (", detail::is_wide(format) ? "a wide product" : "autocast",
                    " runs it)");
}

std::string scale_rule_of(LayerFormat format, uint64_t seed) {
  switch (format) {
    case LayerFormat::kBFloat16:
      return "autocast (no scale)";
    case LayerFormat::kFloat32:
      return "float32 products (no scale)";
    case LayerFormat::kFloat16:
      return "float16 products, operands scaled per product to a worst case of 2^15";
    default:
      return recipe_of(format, seed).to_string();
  }
}

LayerFormat wider_format(LayerFormat format, const std::string& target) {
  // float16's range is float32's to widen into; bf16 and fp32 are as wide
  // as the watch's reference or wider.
  if (format == LayerFormat::kFloat16) return LayerFormat::kFloat32;
  if (!detail::is_fp8(format)) return format;
  // Only the published targets' models are consulted: "cpu" would time
  // every format, and it runs them all.
  const bool published = target == "h100" || target == "b200";
  const CostModel model = published ? cost_model_for(target) : CostModel();
  LayerFormat wider = format;
  for (const auto& f : kFormats) {  // widest first: the last runnable one before `format`
    if (!detail::is_fp8(f.format) && f.format != LayerFormat::kBFloat16) continue;  // not FP8's way
    if (f.format == format) return wider;
    if (!published || f.format == LayerFormat::kBFloat16 || model.throughput.count(f.format)) {
      wider = f.format;
    }
  }
  TORCH_CHECK(false, "ampx::plan: unknown LayerFormat ", static_cast<int>(format));
}

CostModel cost_model_for(const std::string& target) {
  // Dense tensor-core peaks, relative to bf16 (docs/numerics.md names the
  // datasheets). H100 SXM: bf16 and fp16 989 TFLOP/s, fp8 1979, fp32 67
  // (without tensor cores: PyTorch's float32 matmul does not take TF32 by
  // default); no FP4 or MX block scaling in hardware (Hopper), so mxfp8 and
  // nvfp4 are absent; TE runs Float8BlockScaling on Hopper at the fp8 rate.
  // B200: bf16 and fp16 2.25 PFLOP/s, fp8 (and MXFP8) 4.5, NVFP4 9, fp32 0.075.
  CostModel m;
  m.target = target;
  if (target == "h100") {
    m.throughput = {{LayerFormat::kFloat32, 67.0 / 989.0},
                    {LayerFormat::kFloat16, 1.0},
                    {LayerFormat::kBFloat16, 1.0},
                    {LayerFormat::kFp8, 1979.0 / 989.0},
                    {LayerFormat::kFp8Block, 1979.0 / 989.0}};
    m.source =
        "NVIDIA H100 SXM5 datasheet, dense: bf16 and fp16 989, fp8 1979, fp32 67 TFLOP/s";
    return m;
  }
  if (target == "b200") {
    m.throughput = {{LayerFormat::kFloat32, 0.075 / 2.25},
                    {LayerFormat::kFloat16, 1.0},
                    {LayerFormat::kBFloat16, 1.0},
                    {LayerFormat::kFp8, 2.0},
                    {LayerFormat::kFp8Block, 2.0},
                    {LayerFormat::kMxfp8, 2.0},
                    {LayerFormat::kNvfp4, 4.0}};
    m.source =
        "NVIDIA HGX B200 datasheet, dense: bf16 and fp16 2.25, fp8/mxfp8 4.5, nvfp4 9, "
        "fp32 0.075 PFLOP/s";
    return m;
  }
  if (target == "cpu") return measure_cpu_cost_model();
  TORCH_CHECK_VALUE(false, "ampx::plan: target '", target, "' has no cost model (h100, b200, cpu)");
}

namespace {

// Seconds per forward and backward of a 256 x 256 Linear on 256 rows in
// `format` under bf16 autocast: the best of 5 after one warm-up.
double time_product(LayerFormat format) {
  torch::manual_seed(0);
  torch::nn::Linear fc(256, 256);
  detail::convert_layers(*fc, {""}, format, 0);
  const auto x = torch::randn({256, 256});
  double best = 1e30;
  for (int i = 0; i < 6; ++i) {
    const auto start = std::chrono::steady_clock::now();
    {
      AutocastGuard autocast(c10::DeviceType::CPU, at::kBFloat16);
      fp8::Fp8AutocastGuard region;
      fc->forward(x).sum().backward();
    }
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i > 0) best = std::min(best, s);
  }
  return best;
}

}  // namespace

CostModel measure_cpu_cost_model() {
  CostModel m;
  m.target = "cpu";
  const double bf16 = time_product(LayerFormat::kBFloat16);
  for (const auto format : all_layer_formats()) {
    m.throughput[format] = format == LayerFormat::kBFloat16 ? 1.0 : bf16 / time_product(format);
  }
  m.source =
      "measured here: forward and backward of a 256 x 256 Linear on 256 rows, "
      "best of 5, FP8 and FP4 emulated";
  return m;
}

}  // namespace plan
}  // namespace ampx
