#pragma once

// The CPU side of ampx::optim's steps: turns ParamWork into the span
// kernels' operands and runs the spans over all params in 64K-element chunks
// (multi-tensor style: many small params parallelise as well as one big one).

#include "ampx/optim/optimizer.h"

#include "../kernels/isa/optim_kernels.h"

#include <cstdint>
#include <functional>
#include <vector>

namespace ampx {
namespace optim {
namespace detail {

namespace cpu = ::ampx::detail::cpu;
using cpu::FusedParam;

/// Pointers, dtype and stochastic-rounding key of `work` (scalars left to the caller).
FusedParam fused_operands(const ParamWork& work, const MixedPrecisionConfig& config,
                          float grad_mul);

/// Adam's moment operands (betas, 1 - betas, eps), computed in double as
/// LibTorch does and rounded to float once; AdamW and LAMB share them.
inline void set_adam_moments(FusedParam& p, double beta1, double beta2, double eps) {
  p.beta1 = static_cast<float>(beta1);
  p.beta2 = static_cast<float>(beta2);
  p.one_minus_beta1 = static_cast<float>(1 - beta1);
  p.one_minus_beta2 = static_cast<float>(1 - beta2);
  p.eps = static_cast<float>(eps);
}

/// The span kernels of the best instruction set this CPU runs.
const cpu::OptimKernels& optim_kernels();

/// Calls span(param_index, begin, end) over every chunk of `params` (numel
/// elements each), in parallel when there is enough work. Chunk boundaries
/// depend only on the sizes, never on the thread count.
template <class Span>
void for_each_chunk(const std::vector<int64_t>& numels, int64_t chunk, Span&& span);

// --- implementation ---------------------------------------------------------

void parallel_chunks(int64_t n_chunks, int64_t total_elems,
                     const std::function<void(int64_t, int64_t)>& body);

constexpr int64_t kChunkElems = 1 << 16;

struct ChunkRef {
  int64_t param;
  int64_t begin;
  int64_t end;
};

std::vector<ChunkRef> make_chunks(const std::vector<int64_t>& numels, int64_t chunk);

template <class Span>
void for_each_chunk(const std::vector<int64_t>& numels, int64_t chunk, Span&& span) {
  const auto chunks = make_chunks(numels, chunk);
  int64_t total = 0;
  for (auto n : numels) total += n;
  parallel_chunks(static_cast<int64_t>(chunks.size()), total, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) span(c, chunks[c].param, chunks[c].begin, chunks[c].end);
  });
}

}  // namespace detail
}  // namespace optim
}  // namespace ampx
