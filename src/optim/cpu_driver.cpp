#include "cpu_driver.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>

namespace ampx {
namespace optim {
namespace detail {

FusedParam fused_operands(const ParamWork& work, const MixedPrecisionConfig& config,
                          float grad_mul) {
  FusedParam p;
  const auto& st = *work.state;
  p.param = work.param.data_ptr();
  p.grad = work.grad.data_ptr();
  p.master = st.master.defined() ? st.master.data_ptr<float>() : nullptr;
  p.exp_avg = st.exp_avg.defined() ? st.exp_avg.data_ptr<float>() : nullptr;
  p.exp_avg_sq = st.exp_avg_sq.defined() ? st.exp_avg_sq.data_ptr<float>() : nullptr;
  p.dtype = work.param.scalar_type();
  p.stochastic_rounding = config.stochastic_rounding && p.dtype == at::kBFloat16 && !p.master;
  p.rng_key = cpu::sr_key(config.seed, st.step, work.position);
  p.grad_mul = grad_mul;
  return p;
}

const cpu::OptimKernels& optim_kernels() {
  static const cpu::OptimKernels kernels = cpu::optim_kernels_for(cpu::best_isa());
  return kernels;
}

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

}  // namespace detail
}  // namespace optim
}  // namespace ampx
