#pragma once

/// \file
/// Weights in and out as safetensors, the format Hugging Face and most
/// frameworks read: a little-endian u64 header length, a JSON header naming
/// each tensor's dtype, shape and byte range, then the raw bytes.
///
/// ```
///   ampx::save_safetensors(*model, "model.safetensors");   // atomically
///   // Python: safetensors.torch.load_model(model, "model.safetensors")
///   ampx::load_safetensors(*model, "model.safetensors");   // names and shapes checked
///   auto tensors = ampx::read_safetensors("model.safetensors");  // name -> CPU tensor
/// ```
///
/// Names are those of named_parameters() and named_buffers() ("blocks.0.fc.weight"),
/// as PyTorch's state_dict() and safetensors.torch name them. dtypes: F64,
/// F32, F16, BF16, I64, I32, I16, I8, U8, BOOL. A file from outside is
/// checked before anything is allocated from it: the header's length and
/// JSON, every dtype, every shape against its byte range, and the ranges
/// against the file (contiguous, in bounds, no overlap, nothing left over);
/// errors name the path and what is wrong.
///
/// Not yet: the FP8 dtypes (F8_E4M3, F8_E5M2) and their scales.

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace ampx {

/// Writes `tensors` (any device; written as their CPU, contiguous bytes) and
/// `metadata` (the header's "__metadata__", string to string) to `path`:
/// a temp file in the same folder, fsync, rename.
void save_safetensors(const std::map<std::string, at::Tensor>& tensors, const std::string& path,
                      const std::map<std::string, std::string>& metadata = {});

/// Every parameter and buffer of `module`, by its full name.
void save_safetensors(const torch::nn::Module& module, const std::string& path,
                      const std::map<std::string, std::string>& metadata = {});

/// The tensors of the file at `path`, on the CPU. `metadata`, if given,
/// receives the header's "__metadata__".
std::map<std::string, at::Tensor> read_safetensors(
    const std::string& path, std::map<std::string, std::string>* metadata = nullptr);

/// Copies the file's tensors into `module`'s parameters and buffers of the
/// same names, converting dtypes as PyTorch's load_state_dict does (a bf16
/// file into an fp32 model), without recording autograd history. Errors,
/// before anything is copied, list the names missing from the file or
/// unknown to the module, and name any tensor whose shape differs.
void load_safetensors(torch::nn::Module& module, const std::string& path);

}  // namespace ampx
