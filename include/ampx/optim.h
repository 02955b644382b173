#pragma once

/// \file
/// ampx::optim: mixed-precision optimizers with fp32 master weights, fused
/// CPU kernels, GradScaler-aware steps and optional stochastic rounding.
///
/// ```
///   ampx::optim::AdamW opt(model->parameters(), ampx::optim::AdamWOptions(3e-4));
///   ampx::GradScaler scaler;
///   ...; scaler.scale(loss).backward(); scaler.step(opt); scaler.update();
/// ```

/// \namespace ampx::optim
/// Mixed-precision optimizers (AdamW, SGD, LAMB) with fp32 master weights,
/// fused updates and GradScaler-aware steps.

#include "ampx/optim/adamw.h"
#include "ampx/optim/lamb.h"
#include "ampx/optim/optimizer.h"
#include "ampx/optim/sgd.h"
#include "ampx/optim/state_file.h"
