#pragma once

// ampx::debug: numerics diagnostics for mixed precision. Named scopes
// (scope.h), the first non-finite op (nonfinite.h), per-layer range
// statistics (range_stats.h), the limits of each format (formats.h) and a
// precision advisor (advisor.h). docs/numerics.md shows how to read them.

#include "ampx/debug/advisor.h"
#include "ampx/debug/formats.h"
#include "ampx/debug/nonfinite.h"
#include "ampx/debug/range_stats.h"
#include "ampx/debug/scope.h"
