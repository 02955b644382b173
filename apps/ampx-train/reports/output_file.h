#pragma once

// ampx-train's output files other than checkpoints and metrics (reports,
// plot data, results, range statistics): written whole or not at all.
//
//   write_output_file(out / "compare.json", json.dump(2) + "\n");
//
// A write that fails (no space left, read-only folder, I/O error) throws a
// c10::Error naming the path and the cause, e.g. "ampx-train: cannot write
// 'runs/gpt/compare.json': No space left on device (...)", and leaves no
// temp file and no half-written file behind.

#include <filesystem>
#include <string>

namespace ampx::train {

void write_output_file(const std::filesystem::path& path, const std::string& text);

}  // namespace ampx::train
