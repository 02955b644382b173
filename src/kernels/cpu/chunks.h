#pragma once

// The multi-tensor loop of ampx's CPU kernels (unscale, fused optimizer
// steps): every tensor is cut into chunks of at most kChunkElems elements and
// the chunks of all tensors run through at::parallel_for together, so that
// many small tensors parallelise as well as one big one.
//
//   for_each_chunk(numels, kChunkElems, [&](int64_t c, int64_t t, int64_t b, int64_t e) {
//     span(tensors[t], b, e);   // chunk c: elements [b, e) of tensor t
//   });

#include <cstdint>
#include <functional>
#include <vector>

namespace ampx {
namespace detail {
namespace cpu {

/// 256 KiB of fp32: one chunk fits in L2.
constexpr int64_t kChunkElems = 1 << 16;

/// Elements [begin, end) of tensor `tensor`: the unit of parallel work.
struct ChunkRef {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

/// The chunks of tensors of `numels` elements, tensor by tensor (a tensor of
/// 0 elements has none). The cut depends only on the sizes, never on the
/// thread count, so per-chunk results combine the same on any machine.
std::vector<ChunkRef> make_chunks(const std::vector<int64_t>& numels, int64_t chunk);

/// body(begin, end) over chunk indices [0, n_chunks): serially below
/// at::internal::GRAIN_SIZE elements in all (or for one chunk), else with
/// at::parallel_for, one chunk per grain.
void parallel_chunks(int64_t n_chunks, int64_t total_elems,
                     const std::function<void(int64_t, int64_t)>& body);

/// Calls span(chunk_index, tensor_index, begin, end) for every chunk of
/// tensors of `numels` elements, in parallel when there is enough work.
template <class Span>
void for_each_chunk(const std::vector<int64_t>& numels, int64_t chunk, Span&& span) {
  const auto chunks = make_chunks(numels, chunk);
  int64_t total = 0;
  for (auto n : numels) total += n;
  parallel_chunks(static_cast<int64_t>(chunks.size()), total, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) span(c, chunks[c].tensor, chunks[c].begin, chunks[c].end);
  });
}

}  // namespace cpu
}  // namespace detail
}  // namespace ampx
