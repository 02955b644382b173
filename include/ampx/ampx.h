#pragma once

// ampx: automatic mixed precision for LibTorch. Include this for everything.

#include "ampx/amp.h"
#include "ampx/autocast.h"
#include "ampx/dist.h"
#include "ampx/grad_scaler.h"
#include "ampx/kernels.h"
#include "ampx/memory.h"
#include "ampx/optim.h"
#include "ampx/policy.h"
#include "ampx/serialize.h"
#include "ampx/version.h"
#include "ampx/zero.h"
