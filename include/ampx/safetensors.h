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
/// F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, and the FP8 ones below. A file
/// from outside is checked before anything is allocated from it: the
/// header's length and JSON, every dtype, every shape against its byte range,
/// and the ranges against the file (contiguous, in bounds, no overlap,
/// nothing left over); errors name the path and what is wrong.
///
/// FP8: the format's F8_E4M3 and F8_E5M2 are PyTorch's torch.float8_e4m3fn
/// and torch.float8_e5m2 (Python's safetensors maps them so), one byte per
/// element. An FP8 tensor's scale is stored beside it as compressed-tensors
/// (vLLM's and Hugging Face's per-tensor FP8 checkpoints) stores a weight's:
/// "<name>_scale", float32, the number the codes' values are multiplied by to
/// give the tensor's values, which is ampx's Fp8Tensor::scale_inv (TE's
/// scale_inv; DeepSeek-V3 calls the same multiplier "<name>_scale_inv" and
/// keeps one per 128 x 128 block):
///
/// ```
///   ampx::SafetensorsContents out;
///   out.fp8["fc.weight"] = ampx::fp8::Fp8Tensor::quantize(w, ampx::fp8::Fp8Format::kE4M3, scale);
///   out.tensors["fc.bias"] = bias;
///   ampx::save_safetensors(out, "fp8.safetensors");
///   // entries: fc.weight F8_E4M3 [out, in], fc.weight_scale F32 (scale_inv), fc.bias F32
///   // Python: w = f.get_tensor("fc.weight").float() * f.get_tensor("fc.weight_scale")
///   //         (bitwise what ampx's Fp8Tensor::dequantize() gives)
///   auto in = ampx::read_safetensors_contents("fp8.safetensors");
///   in.fp8.at("fc.weight");  // the same codes, scale_inv and format, bitwise
/// ```
///
/// read_safetensors_contents() reads FP8 on every LibTorch. read_safetensors()
/// gives F8 entries as float8 tensors where LibTorch has those dtypes (2.1+,
/// AMPX_HAS_TORCH_FLOAT8; their scales as the plain tensors they are, as
/// Python's safetensors does); LibTorch 1.13 has none, and there it refuses a
/// file with F8 entries, naming read_safetensors_contents(), rather than give
/// the codes as uint8 that would read as integers. save_safetensors() of a map
/// writes float8 tensors (2.1+) as F8_E4M3 / F8_E5M2. load_safetensors()
/// loads an FP8 entry with its scale into a module's floating tensor of that
/// name as its values (codes times scale_inv, computed in float32).
///
/// Not read: the other FP8 dtypes of the format (F8_E4M3FNUZ, F8_E5M2FNUZ,
/// F8_E8M0) and FP8 scales of more than one element (per channel, per block):
/// refused with an error naming the entry.

#include "ampx/fp8/cast.h"

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

/// A safetensors file's entries with its FP8 ones as codes, scale and
/// format: what save_safetensors() writes and read_safetensors_contents()
/// reads, on every LibTorch.
struct SafetensorsContents {
  /// Every other entry by its name (float8 tensors too, on LibTorch 2.1+).
  std::map<std::string, at::Tensor> tensors;
  /// FP8 tensors by name: entry "<name>" (F8_E4M3 or F8_E5M2, the codes'
  /// bytes) and entry fp8_scale_name(name) (F32, scale_inv's shape and value).
  std::map<std::string, fp8::Fp8Tensor> fp8;
  /// The header's "__metadata__".
  std::map<std::string, std::string> metadata;
};

/// The name of the entry that holds FP8 tensor `name`'s scale_inv:
/// fp8_scale_name("fc.weight") == "fc.weight_scale".
std::string fp8_scale_name(const std::string& name);

/// Writes `contents` to `path` as save_safetensors() above does. An FP8
/// tensor's codes must be uint8 and its scale_inv one float32 element; a name
/// used twice (a tensor and an FP8 tensor's scale entry) is an error.
void save_safetensors(const SafetensorsContents& contents, const std::string& path);

/// The file at `path` with every F8_E4M3 / F8_E5M2 entry as an Fp8Tensor
/// (codes uint8, on the CPU) whose scale_inv is the entry "<name>_scale",
/// or DeepSeek-V3's "<name>_scale_inv" (either F32, BF16 or F16 with one
/// element, widened to float32 exactly; both at once is an error); an FP8
/// entry without either has scale_inv 1 (its codes are its values, as
/// Python's `x.to(torch.float8_e4m3fn)` saves them). A scale of more than one
/// element is refused, naming it. The other entries are in `tensors`.
SafetensorsContents read_safetensors_contents(const std::string& path);

}  // namespace ampx
