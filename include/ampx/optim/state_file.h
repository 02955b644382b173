#pragma once

/// \file
/// An optimizer's state as a safetensors file that Python reads: the
/// moments as they are kept (8-bit and FP8 codes with their block scales,
/// bf16 or fp32 values), the step counts, the fp32 masters and Kahan
/// compensations, each under its parameter's name, in the layout of
/// torchao's low-bit optimizer states (a code tensor of the parameter's
/// shape and one fp32 scale per block of state_block elements).
///
/// ```
///   ampx::optim::save_optimizer_safetensors(opt, *model, "optim.safetensors");
///   ampx::optim::load_optimizer_safetensors(opt, *model, "optim.safetensors");
///   # Python: tools/optim_state_torchao.py moves it into torchao's
///   #         AdamW8bit / AdamWFp8 / torch's AdamW, and theirs into it
/// ```
///
/// Entries, for a parameter named `N` (its name in model.named_parameters())
/// that has state:
///
/// ```
///   N.step                        I64 []  steps taken
///   N.exp_avg, N.exp_avg_sq       the parameter's shape: F32, BF16 (state_format
///                                 bf16), or U8 codes (8bit: the index into the
///                                 map below; fp8: E4M3's bits); SGD's momentum
///                                 buffer is N.exp_avg
///   N.exp_avg.scale,              F32 [ceil(numel / state_block)]: 8bit and fp8's
///   N.exp_avg_sq.scale            block scales; value = map[code] * scale (8bit),
///                                 e4m3(code) * scale (fp8)
///   N.master                      F32, the fp32 master of a bf16/fp16 parameter
///   N.compensation                the parameter's dtype: Kahan's lost low bits
///   ampx.map_signed,              F32 [256] (8bit only): bitsandbytes' dynamic
///   ampx.map_unsigned             map of the first and second moment
/// ```
///
/// and the header's metadata: format "ampx.optimizer_state", format_version
/// "1", optimizer ("AdamW", "LAMB", "SGD"), state_format ("fp32", "bf16",
/// "fp8", "8bit"), state_block, kahan_summation ("0", "1") and seed (the
/// stochastic roundings' stream, decimal).
///
/// A load checks the whole file before it changes anything and names what
/// it refuses: another optimizer; codes or bf16 moments of another
/// state_format or state_block than this optimizer's (fp32 moments, which
/// torchao keeps for small parameters, are encoded into this optimizer's
/// format); an entry of a parameter the model does not have, or of the
/// wrong dtype or shape; a moment without its step. A parameter without
/// entries starts afresh at its next step, as do a master and a
/// compensation the file lacks (made from the parameter then).

#include "ampx/optim/optimizer.h"

#include <string>
#include <vector>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace ampx {
namespace optim {

/// The names `model` gives the optimizer's params (named_parameters()),
/// in group order; throws naming the position of a param it does not hold.
std::vector<std::string> param_names(const MixedPrecisionOptimizer& optimizer,
                                     const torch::nn::Module& model);

/// Writes `optimizer`'s state (the layout above) to `path`, atomically.
void save_optimizer_safetensors(const MixedPrecisionOptimizer& optimizer,
                                const torch::nn::Module& model, const std::string& path);

/// Reads a file of the layout above into `optimizer`, whose params `model`
/// names: all of it checked first, nothing changed on an error.
void load_optimizer_safetensors(MixedPrecisionOptimizer& optimizer, const torch::nn::Module& model,
                                const std::string& path);

}  // namespace optim
}  // namespace ampx
