#pragma once

// Files that Python's torch.load and torch.save understand: state dicts
// pickled with LibTorch's serialization (torch::pickle_save), written
// atomically so an existing file is never left half-overwritten.
//
//   ampx::save_state_dict(scaler.state_dict(), "scaler.pt");
//   // Python: torch.load("scaler.pt") -> {'scale': 65536.0, ...}
//   scaler.load_state_dict(ampx::load_state_dict("from_python.pt"));

#include "ampx/grad_scaler.h"

#include <string>

namespace ampx {

/// Writes `dict` to `path` in torch.save's format (temp file in the same
/// folder, fsync, rename). Values: None, bool, int, float, str, or lists of
/// them, so that torch.load(path, weights_only=True) reads it.
void save_state_dict(const StateDict& dict, const std::string& path);

/// Reads a dict saved by `save_state_dict` or by Python's `torch.save(dict)`.
/// Errors name the path: missing, unreadable, corrupt, or not a str-keyed dict.
StateDict load_state_dict(const std::string& path);

}  // namespace ampx
