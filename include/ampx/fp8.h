#pragma once

// FP8 (8-bit floating point) training support, after NVIDIA Transformer Engine:
//   ampx/fp8/cast.h     E4M3 / E5M2 codes: quantize, dequantize, round_to_fp8
//   ampx/fp8/scaling.h  DelayedScaling and CurrentScaling recipes
//   ampx/fp8/linear.h   fp8::Linear, Fp8AutocastGuard, model conversion
// See docs/fp8.md for what exists, where it differs from TE, and what is next.

#include "ampx/fp8/cast.h"
#include "ampx/fp8/scaling.h"
#include "ampx/fp8/linear.h"
