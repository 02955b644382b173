#include "output_file.h"

#include "files/atomic_file.h"  // ampx's src/: crash-safe writes

namespace ampx::train {

void write_output_file(const std::filesystem::path& path, const std::string& text) {
  ampx::detail::write_file_atomically(path.string(), text.data(), text.size(), "ampx-train");
}

}  // namespace ampx::train
