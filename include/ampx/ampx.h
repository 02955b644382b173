#pragma once

// ampx: automatic mixed precision for LibTorch. Include this for everything.

#include "ampx/autocast.h"
#include "ampx/grad_scaler.h"
#include "ampx/kernels.h"
#include "ampx/serialize.h"
#include "ampx/version.h"
