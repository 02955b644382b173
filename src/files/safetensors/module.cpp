// A module's parameters and buffers in and out of a safetensors file
// (ampx/safetensors.h): save_safetensors(module) and load_safetensors, by
// the names of named_parameters() and named_buffers().

#include "ampx/safetensors.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

namespace ampx {
namespace {

std::map<std::string, at::Tensor> named_tensors(const torch::nn::Module& module) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) out[p.key()] = p.value();
  for (const auto& b : module.named_buffers(/*recurse=*/true)) out[b.key()] = b.value();
  return out;
}

}  // namespace

void save_safetensors(const torch::nn::Module& module, const std::string& path,
                      const std::map<std::string, std::string>& metadata) {
  save_safetensors(named_tensors(module), path, metadata);
}

void load_safetensors(torch::nn::Module& module, const std::string& path) {
  const std::string where = "load_safetensors: '" + path + "'";
  auto contents = read_safetensors_contents(path);
  std::map<std::string, at::Tensor>& file = contents.tensors;
  for (const auto& [name, t] : contents.fp8) file.emplace(name, t.dequantize());  // float32 values
  const auto mine = named_tensors(module);
  std::string missing, unexpected;
  for (const auto& [name, t] : mine) {
    if (!file.count(name)) missing += (missing.empty() ? "" : ", ") + name;
  }
  for (const auto& [name, t] : file) {
    if (!mine.count(name)) unexpected += (unexpected.empty() ? "" : ", ") + name;
  }
  TORCH_CHECK(missing.empty() && unexpected.empty(), where,
              " does not fit this module:", missing.empty() ? "" : " missing " + missing + ";",
              unexpected.empty() ? "" : " unexpected " + unexpected + ";");
  for (const auto& [name, t] : mine) {
    const auto& src = file.at(name);
    TORCH_CHECK(src.sizes() == t.sizes(), where, ": tensor '", name, "' has shape ", src.sizes(),
                " in the file and ", t.sizes(), " in the module");
    TORCH_CHECK(!contents.fp8.count(name) || t.is_floating_point(), where, ": FP8 tensor '", name,
                "' goes into a floating-point tensor; the module's is ", t.scalar_type());
  }
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : mine) {
    at::Tensor dst = t;
    dst.copy_(file.at(name));  // converting the dtype, as load_state_dict does
  }
}

}  // namespace ampx
