// ProcessGroup::Impl's asynchronous collectives and their waits: what
// ProcessGroup's collectives and FullyShardedDataParallel's overlapped
// gathers and reduce-scatters start and finish.

#include "process_group_impl.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <exception>
#include <utility>
#include <vector>

namespace ampx {
namespace dist {

std::pair<double, double> divide_factors(int64_t world, c10::ScalarType dtype) {
  if (dtype != c10::kHalf) return {1.0, static_cast<double>(world)};
  int64_t factor = 1;
  while (world % factor == 0 && world / factor > factor) factor *= 2;
  return {static_cast<double>(factor), static_cast<double>(world) / static_cast<double>(factor)};
}

#if defined(AMPX_WITH_DIST)

void ProcessGroup::Impl::wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) const {
  try {
    work->wait(collective_timeout);
  } catch (const std::exception& e) {
    fail(what, e);
  }
}

void ProcessGroup::Impl::stream_wait(const c10::intrusive_ptr<c10d::Work>& work,
                                     const char* what) const {
  try {
    // c10d's kNoTimeout (a global before LibTorch 2.x): the host does not wait
    work->wait(std::chrono::milliseconds(0));
  } catch (const std::exception& e) {
    fail(what, e);
  }
}

void ProcessGroup::Impl::wait(ReduceScatter& rs) const {
  wait(rs.work, rs.via_all_reduce ? "all-reduce (for a reduce-scatter)" : "reduce-scatter");
  if (rs.via_all_reduce) {
    const int64_t n = rs.output.numel();
    rs.output.copy_(rs.input.narrow(0, rank * n, n));
  }
}

ProcessGroup::Impl::ReduceScatter ProcessGroup::Impl::reduce_scatter_async(at::Tensor& output,
                                                                           at::Tensor& input) {
  const int64_t n = output.numel();
  TORCH_CHECK(output.dim() == 1 && input.dim() == 1 && input.numel() == n * world_size &&
                  input.scalar_type() == output.scalar_type() && input.is_contiguous(),
              "ampx::dist::reduce_scatter_sum: input must be 1-D, contiguous, world_size (",
              world_size, ") x output's ", n, " elements and of output's dtype; got ",
              input.numel(), " ", input.scalar_type(), " for ", output.scalar_type());
  ReduceScatter rs;
  rs.output = output;
  rs.input = input;
  const bool on_nccl = nccl && input.is_cuda();
  if (on_nccl || gloo_reduce_scatter) {
    std::vector<at::Tensor> outputs{output};
    std::vector<std::vector<at::Tensor>> inputs(1);
    for (int64_t r = 0; r < world_size; ++r) inputs[0].push_back(input.narrow(0, r * n, n));
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    o.timeout = collective_timeout;
    try {
      rs.work = backend_for(input).reduce_scatter(outputs, inputs, o);
      ++*collectives;
      return rs;
    } catch (const std::exception&) {
      // Gloo's refusal comes before any communication, on every rank alike
      // ("does not support reduce_scatter"): fall back to an all-reduce from
      // now on. NCCL has one: its errors are errors.
      if (on_nccl) throw;
      gloo_reduce_scatter = false;
    }
  }
  rs.via_all_reduce = true;
  rs.work = all_reduce_async(input, c10d::ReduceOp::SUM);
  return rs;
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::Impl::all_gather_async(at::Tensor& output,
                                                                    const at::Tensor& input) {
  const int64_t n = input.numel();
  TORCH_CHECK(input.dim() == 1 && output.dim() == 1 && output.numel() == n * world_size &&
                  input.scalar_type() == output.scalar_type() && output.is_contiguous(),
              "ampx::dist::all_gather: output must be 1-D, contiguous, world_size (", world_size,
              ") x input's ", n, " elements and of input's dtype; got ", output.numel(), " ",
              output.scalar_type(), " for ", input.scalar_type());
  // (n elements each, as many wire elements: bytes for 16-bit types)
  auto wire_in = as_wire(input.contiguous()), wire_out = as_wire(output);
  const int64_t wn = wire_in.numel();
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int64_t r = 0; r < world_size; ++r) outputs[0].push_back(wire_out.narrow(0, r * wn, wn));
  std::vector<at::Tensor> inputs{wire_in};
  c10d::AllgatherOptions o;
  o.timeout = collective_timeout;
  ++*collectives;
  return backend_for(input).allgather(outputs, inputs, o);
}

#endif  // AMPX_WITH_DIST

}  // namespace dist
}  // namespace ampx
