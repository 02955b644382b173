#pragma once

/// \file
/// StateDict: a string-keyed dictionary of plain values, what state_dict()
/// returns across ampx (GradScaler, initialize()'s loss scalers) and what
/// Python's `GradScaler.state_dict()` holds: float and int values, None.
/// ampx/serialize.h writes and reads it in torch.save's format.
///
/// ```
///   ampx::StateDict sd = scaler.state_dict();
///   sd.at("scale").toDouble();  // 65536.0
/// ```

#include <ATen/core/ivalue.h>

#include <map>
#include <string>

namespace ampx {

/// A string-keyed dictionary of plain values (None, bool, int, float, str).
using StateDict = std::map<std::string, c10::IValue>;

}  // namespace ampx
