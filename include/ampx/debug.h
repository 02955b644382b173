#pragma once

/// \file
/// ampx::debug: numerics diagnostics for mixed precision. Named scopes
/// (scope.h), the first non-finite op (nonfinite.h), per-layer range
/// statistics (range_stats.h), the limits of each format (formats.h) and a
/// precision advisor (advisor.h). docs/numerics.md shows how to read them.

/// \namespace ampx::debug
/// Numerics diagnostics for mixed precision: named scopes, the first
/// non-finite op, range statistics, format limits and the precision advisor.

#include "ampx/debug/advisor.h"
#include "ampx/debug/formats.h"
#include "ampx/debug/nonfinite.h"
#include "ampx/debug/range_stats.h"
#include "ampx/debug/scope.h"
