#pragma once

/// \file
/// Files that Python's torch.load and torch.save understand: state dicts
/// pickled with LibTorch's serialization (torch::pickle_save), written
/// atomically so an existing file is never left half-overwritten. And
/// LibTorch's own archives (torch::save of a module, an optimizer, a
/// ZeroRedundancyOptimizer shard), written atomically and read back only
/// after a check that LibTorch's reader can take them: its readers crash or
/// allocate without bound on some crafted files (tests/fuzz/README.md).
///
/// ```
///   ampx::save_state_dict(scaler.state_dict(), "scaler.pt");
///   // Python: torch.load("scaler.pt") -> {'scale': 65536.0, ...}
///   scaler.load_state_dict(ampx::load_state_dict("from_python.pt"));
/// ```
///
/// ```
///   torch::serialize::OutputArchive out;
///   zero.save(out);                                   // this rank's shard
///   ampx::save_archive(out, "zero-rank1.pt");
///   torch::serialize::InputArchive in;
///   ampx::load_archive(in, "zero-rank1.pt");          // checked, then read
///   zero.load(in);
/// ```

#include "ampx/state_dict.h"

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <string>

namespace ampx {

/// Writes `dict` to `path` in torch.save's format (temp file in the same
/// folder, fsync, rename). Values: None, bool, int, float, str, or lists of
/// them, so that torch.load(path, weights_only=True) reads it.
void save_state_dict(const StateDict& dict, const std::string& path);

/// Reads a dict saved by `save_state_dict` or by Python's `torch.save(dict)`.
/// Errors name the path: missing, unreadable, corrupt, or not a str-keyed dict.
StateDict load_state_dict(const std::string& path);

/// Writes `archive` to `path` as torch::save does, atomically (temp file in
/// the same folder, fsync, rename): a crash leaves the old file or the new one.
void save_archive(torch::serialize::OutputArchive& archive, const std::string& path);

/// Reads a file torch::serialize::OutputArchive wrote (torch::save,
/// save_archive) into `archive`. Before LibTorch reads it, the file must be
/// what OutputArchive writes: zip records and pickle lengths within the
/// file, TorchScript code only the attribute classes OutputArchive writes,
/// data.pkl only modules, tensors within their storages and plain values.
/// Errors name the path and what is wrong.
void load_archive(torch::serialize::InputArchive& archive, const std::string& path);

}  // namespace ampx
