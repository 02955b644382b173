#pragma once

// How ampx-train's AdamW keeps its state: --masters (what keeps a 16-bit
// weight's lost bits) and --optimizer-state (the moments' format), their
// checks, their row of the settings table, and the bytes the optimizer
// holds for the results; and fp16's loss scaler (--init-scale,
// --growth-interval).
//
//   add_optimizer_options(app, config);          // the flags
//   check_optimizer_config(config);              // from resolve_defaults()
//   apply_optimizer_options(config, mode, options, amp);  // set_up_mode()'s options

#include "cli/config.h"

#include <ampx/grad_scaler.h>
#include <ampx/optim.h>

#include <torch/nn/module.h>

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

namespace ampx::train {

void add_optimizer_options(CLI::App& app, TrainConfig& config);

/// Combinations CLI11 cannot check; throws c10::Error naming the flags.
void check_optimizer_config(const TrainConfig& config);

/// What keeps mode `mode`'s weights: "fp32" (an fp32 master), "kahan",
/// "stochastic", "nearest" (O3 in fp16) or "" (fp32 and O1: fp32 weights).
std::string masters_of(const TrainConfig& config, const Mode& mode);
/// Mode `mode`'s optimizer state: its name's "+" part, else --optimizer-state.
std::string optimizer_state_of(const TrainConfig& config, const Mode& mode);

/// Sets `options` (AdamW's) for mode `mode`: masters, stochastic rounding
/// or Kahan compensation, and the moments' format; and `amp_options` to
/// keep no masters where O2's 16-bit weights keep their lost bits another way.
void apply_optimizer_options(const TrainConfig& config, const Mode& mode,
                             ampx::optim::AdamWOptions& options, ampx::AmpOptions& amp_options);

/// Sets `scaler` (a mode's loss scaler, when it has one) to start at
/// --init-scale and grow every --growth-interval clean steps, where given.
void apply_loss_scale_options(const TrainConfig& config, ampx::GradScaler& scaler);

/// The settings table's row: the masters per mode and the moments' format.
std::string optimizer_description(const TrainConfig& config);

/// The bytes `optimizer` keeps (ampx::optim's, ZeRO's; 0 for another kind).
int64_t optimizer_state_bytes(torch::optim::Optimizer& optimizer);

/// The bytes `model`'s parameters and their gradients hold now (counted
/// from the tensors: bf16 or fp32 each as it is; a sharded module's
/// parameters between steps are empty).
int64_t weight_and_grad_bytes(const torch::nn::Module& model);

}  // namespace ampx::train
