#pragma once

/// \file
/// ampx: automatic mixed precision for LibTorch. Include this for everything
/// but data parallelism, which needs c10d: include "ampx/dist.h" (process
/// groups, DistributedDataParallel), "ampx/zero.h" (ZeRO-1) and "ampx/fsdp.h"
/// (fully sharded) for that, and
/// "ampx/debug.h" for the numerics diagnostics (ampx::debug).

/// \namespace ampx
/// Automatic mixed precision for LibTorch: autocast, GradScaler, Apex-style
/// opt levels, cast policies, mixed-precision kernels and state files.

#include "ampx/amp.h"
#include "ampx/autocast.h"
#include "ampx/checkpoint.h"
#include "ampx/direction.h"
#include "ampx/fp8.h"
#include "ampx/grad_scaler.h"
#include "ampx/kernels.h"
#include "ampx/memory.h"
#include "ampx/optim.h"
#include "ampx/policy.h"
#include "ampx/precision_plan.h"
#include "ampx/safetensors.h"
#include "ampx/scale_update.h"
#include "ampx/scaler_aware_optimizer.h"
#include "ampx/serialize.h"
#include "ampx/state_dict.h"
#include "ampx/version.h"
