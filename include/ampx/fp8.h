#pragma once

/// \file
/// FP8 (8-bit floating point) training support, after NVIDIA Transformer Engine:
///
/// ```
///   ampx/fp8/block.h    block-scaled formats: MXFP8, MXFP6, MXFP4, NVFP4, FP8 blockwise:
///                       codes and scales by each rule in use (BlockTensor)
///   ampx/fp8/cast.h     E4M3 / E5M2 codes: quantize, dequantize, round_to_fp8
///   ampx/fp8/scaling.h  DelayedScaling and CurrentScaling recipes, the per-role
///                       scaling states of a layer (TensorScaling, LinearScaling)
///   ampx/fp8/autocast.h Fp8AutocastGuard: the region, and its amax reduction
///   ampx/fp8/convert.h  convert_linears: torch::nn::Linear layers to FP8 in place
///   ampx/fp8/linear.h   fp8::Linear (includes autocast.h and convert.h)
/// ```
/// See docs/fp8.md for what exists, where it differs from TE, and what is next.

/// \namespace ampx::fp8
/// FP8 training after Transformer Engine: casts, scaling recipes, the FP8
/// region and FP8 linear layers.

#include "ampx/fp8/autocast.h"
#include "ampx/fp8/block.h"
#include "ampx/fp8/cast.h"
#include "ampx/fp8/convert.h"
#include "ampx/fp8/linear.h"
#include "ampx/fp8/scaling.h"
