#include "chunks.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace ampx {
namespace detail {
namespace cpu {

std::vector<ChunkRef> make_chunks(const std::vector<int64_t>& numels, int64_t chunk) {
  std::vector<ChunkRef> chunks;
  for (size_t i = 0; i < numels.size(); ++i) {
    for (int64_t b = 0; b < numels[i]; b += chunk) {
      chunks.push_back({static_cast<int64_t>(i), b, std::min(b + chunk, numels[i])});
    }
  }
  return chunks;
}

void parallel_chunks(int64_t n_chunks, int64_t total_elems,
                     const std::function<void(int64_t, int64_t)>& body) {
  constexpr int64_t kSerialBelowElems = 1 << 15;  // at::internal::GRAIN_SIZE
  if (total_elems < kSerialBelowElems || n_chunks <= 1) {
    body(0, n_chunks);
  } else {
    at::parallel_for(0, n_chunks, 1, body);
  }
}

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
