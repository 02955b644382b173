// DistributedDataParallel: bucketed gradient all-reduce launched from
// gradient hooks, overlapped with the rest of backward.

#include "ampx/dist.h"

#include "model_check.h"
#include "process_group_impl.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace ampx {
namespace dist {

#if defined(AMPX_WITH_DIST)

namespace {

/// What must be equal on every rank for the broadcast and the buckets to
/// pair up: each parameter and buffer, and the options that decide the buckets.
std::vector<std::pair<std::string, std::string>> describe(
    const torch::nn::Module& module, const DistributedDataParallelOptions& options) {
  auto out = detail::describe_module(module);
  const auto cdt = options.communication_dtype();
  out.emplace_back("option communication_dtype",
                   cdt ? std::string(c10::toString(*cdt)) : std::string("(each gradient's own)"));
  out.emplace_back("option bucket_cap_bytes", std::to_string(options.bucket_cap_bytes()));
  out.emplace_back("option first_bucket_cap_bytes",
                   std::to_string(options.first_bucket_cap_bytes()));
  out.emplace_back("option find_unused_parameters",
                   options.find_unused_parameters() ? "true" : "false");
  out.emplace_back("option broadcast_parameters",
                   options.broadcast_parameters() ? "true" : "false");
  return out;
}

}  // namespace

struct DistributedDataParallel::Impl {
  struct Bucket {
    std::vector<int64_t> params;  // indices into params
    at::Tensor flat;              // all its gradients, in the communication dtype
    int64_t pending = 0;
    c10::intrusive_ptr<c10d::Work> work;
  };

  Impl(std::shared_ptr<torch::nn::Module> m, ProcessGroup g, DistributedDataParallelOptions o)
      : module(std::move(m)), group(std::move(g)), options(std::move(o)) {}

  void build_buckets() {
    for (const auto& p : module->named_parameters()) {
      if (!p.value().requires_grad()) continue;
      names.push_back(p.key());
      params.push_back(p.value());
    }
    bucket_of.assign(params.size(), -1);
    offset_of.assign(params.size(), 0);
    // Reverse order of registration: the last layers' gradients are ready
    // first in backward, so the first bucket fills first.
    std::vector<int64_t> numel;  // per bucket, while filling
    std::vector<at::TensorOptions> kind;
    for (int64_t i = static_cast<int64_t>(params.size()) - 1; i >= 0; --i) {
      const auto& p = params[i];
      auto dtype = options.communication_dtype().value_or(p.scalar_type());
      if (std::count(unsummable.begin(), unsummable.end(), dtype) > 0) {
        dtype = at::kFloat;  // widen: exact, 2x bytes
      }
      const auto width = static_cast<int64_t>(c10::elementSize(dtype));
      const int64_t cap = buckets.size() == 1
                              ? std::min(options.first_bucket_cap_bytes(), options.bucket_cap_bytes())
                              : options.bucket_cap_bytes();
      const bool fits = !buckets.empty() && kind.back().dtype() == dtype &&
                        kind.back().device() == p.device() &&
                        (numel.back() + p.numel()) * width <= std::max(cap, p.numel() * width);
      if (!fits) {
        buckets.emplace_back();
        numel.push_back(0);
        kind.push_back(p.options().dtype(dtype));
      }
      buckets.back().params.push_back(i);
      bucket_of[i] = static_cast<int64_t>(buckets.size()) - 1;
      offset_of[i] = numel.back();
      numel.back() += p.numel();
    }
    for (size_t b = 0; b < buckets.size(); ++b) {
      buckets[b].flat = torch::empty({numel[b]}, kind[b]);
      buckets[b].pending = static_cast<int64_t>(buckets[b].params.size());
    }
    ready.assign(params.size(), false);
  }

  /// Parameter i's gradient inside its bucket.
  at::Tensor view_of(int64_t i) {
    return buckets[bucket_of[i]].flat.narrow(0, offset_of[i], params[i].numel());
  }

  // Called with the lock held.
  void mark_ready(int64_t i, const at::Tensor& value) {
    TORCH_CHECK(!ready[i], "DistributedDataParallel: parameter '", names[i],
                "' got a second gradient before synchronize(); call synchronize() after each "
                "backward (or use no_sync() to accumulate)");
    view_of(i).copy_(value.reshape({-1}));
    ready[i] = true;
    if (--buckets[bucket_of[i]].pending == 0) launch_ready_buckets();
  }

  // Collectives pair up across ranks by the order they are issued in, so
  // buckets go out in bucket order on every rank, whatever order they fill
  // in (ranks whose unused parameters differ fill them in different orders):
  // a full bucket waits for the ones before it.
  void launch_ready_buckets() {
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) {
      auto& b = buckets[next_bucket++];
      // fp16 sums of `world` gradients overflow where their mean does not:
      // part of the division comes first (PyTorch's DDP divides it all first).
      const double pre = divide_factors(group.world_size(), b.flat.scalar_type()).first;
      if (pre != 1.0) b.flat.div_(pre);
      b.work =
          detail::ProcessGroupAccess::impl(group).all_reduce_async(b.flat, c10d::ReduceOp::SUM);
    }
  }

  void on_grad(int64_t i, const at::Tensor& grad) {
    if (!sync) return;
    torch::NoGradGuard no_grad;
    std::lock_guard<std::mutex> lock(mutex);
    // After no_sync iterations .grad holds the gradients accumulated so far;
    // the hook sees this backward's part before it is added.
    const auto& acc = params[i].grad();
    mark_ready(i, acc.defined() ? acc + grad : grad);
  }

  void synchronize() {
    if (!sync) return;
    torch::NoGradGuard no_grad;
    std::lock_guard<std::mutex> lock(mutex);
    std::vector<std::string> unused;
    for (size_t i = 0; i < params.size(); ++i) {
      if (ready[i]) continue;
      if (!options.find_unused_parameters()) {
        unused.push_back(names[i]);
        continue;
      }
      const auto& acc = params[i].grad();
      mark_ready(static_cast<int64_t>(i), acc.defined() ? acc : torch::zeros_like(params[i]));
    }
    if (!unused.empty()) {
      std::string list;
      for (const auto& n : unused) list += (list.empty() ? "" : ", ") + n;
      reset();
      TORCH_CHECK(false, "DistributedDataParallel: ", unused.size(),
                  " parameter(s) received no gradient in this iteration: ", list,
                  ". Construct it with find_unused_parameters(true) to treat them as zero, or "
                  "freeze them (requires_grad false) before wrapping");
    }
    for (auto& b : buckets) {
      const double post = divide_factors(group.world_size(), b.flat.scalar_type()).second;
      try {
        b.work->wait(detail::ProcessGroupAccess::impl(group).collective_timeout);
      } catch (const std::exception& e) {
        reset();
        detail::ProcessGroupAccess::impl(group).fail("gradient all-reduce", e);
      }
      bytes += b.flat.numel() * static_cast<int64_t>(b.flat.element_size());
      for (const int64_t i : b.params) {
        auto& p = params[i];
        // Divided in the wider of the two types: a sum widened to float32
        // (16-bit gradients this Gloo cannot sum) may not fit a 16-bit type
        // before it is divided; a float32 gradient sent in 16 bits is
        // divided after it is widened back.
        auto sum = view_of(i).view(p.sizes());
        auto averaged = sum.element_size() > p.element_size()
                            ? sum.mul_(1.0 / post).to(p.scalar_type())
                            : sum.to(p.scalar_type()).mul_(1.0 / post);
        if (p.grad().defined()) {
          p.mutable_grad().copy_(averaged);
        } else {
          p.mutable_grad() = averaged;
        }
      }
    }
    reset();
  }

  void reset() {
    std::fill(ready.begin(), ready.end(), false);
    next_bucket = 0;
    for (auto& b : buckets) {
      b.pending = static_cast<int64_t>(b.params.size());
      b.work.reset();
    }
  }

  std::shared_ptr<torch::nn::Module> module;
  ProcessGroup group;
  DistributedDataParallelOptions options;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<int64_t> bucket_of, offset_of;  // per parameter
  std::vector<bool> ready;
  std::vector<Bucket> buckets;
  size_t next_bucket = 0;  // the first bucket not launched yet
  std::vector<unsigned> hooks;
  bool sync = true;
  std::vector<at::ScalarType> unsummable;  // 16-bit types this Gloo cannot all-reduce
  int64_t bytes = 0;
  std::mutex mutex;
};

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 ProcessGroup group,
                                                 DistributedDataParallelOptions options) {
  TORCH_CHECK(module != nullptr, "DistributedDataParallel: module is null");
  const auto cdt = options.communication_dtype();
  TORCH_CHECK(!cdt || *cdt == at::kFloat || *cdt == at::kHalf || *cdt == at::kBFloat16,
              "DistributedDataParallel: communication_dtype must be float32, float16 or "
              "bfloat16, got ",
              *cdt);
  TORCH_CHECK(options.bucket_cap_bytes() > 0,
              "DistributedDataParallel: bucket_cap_bytes must be > 0, got ",
              options.bucket_cap_bytes());
  TORCH_CHECK(options.first_bucket_cap_bytes() > 0,
              "DistributedDataParallel: first_bucket_cap_bytes must be > 0, got ",
              options.first_bucket_cap_bytes());
  detail::check_same_on_every_rank(describe(*module, options), group, "DistributedDataParallel");
  impl_ = std::make_unique<Impl>(std::move(module), std::move(group), std::move(options));
  auto* impl = impl_.get();
  if (impl->options.broadcast_parameters()) {
    detail::broadcast_from_rank_zero(*impl->module, impl->group);
  }
  // Probes run where the gradients will travel: Gloo for CPU parameters,
  // NCCL (where there is one) for CUDA ones.
  c10::Device device(c10::kCPU);
  for (const auto& p : impl->module->parameters()) {
    if (p.requires_grad()) {
      device = p.device();
      break;
    }
  }
  if (cdt && *cdt != at::kFloat) {
    // Gloo builds differ in the types they can sum (LibTorch 1.13's has no
    // bfloat16, Debian's 2.14 neither bfloat16 nor float16): find out now,
    // on every rank, rather than mid-backward, and name what does work.
    const auto sums = [&](at::ScalarType type) {
      auto probe = torch::ones({1}, torch::TensorOptions().dtype(type).device(device));
      try {
        impl->group.all_reduce_sum(probe);
        return std::string();
      } catch (const c10::Error& e) {
        return std::string(e.what_without_backtrace());
      }
    };
    if (const auto error = sums(*cdt); !error.empty()) {
      const auto other = *cdt == at::kBFloat16 ? at::kHalf : at::kBFloat16;
      const bool other_works = sums(other).empty();  // every rank probes both alike
      TORCH_CHECK(
          false, "DistributedDataParallel: this LibTorch's ",
          device.is_cuda() && impl->group.has_nccl() ? "NCCL" : "Gloo", " cannot all-reduce ", *cdt,
          " gradients (communication_dtype); use ",
          other_works ? (other == at::kHalf ? "torch::kHalf or " : "torch::kBFloat16 or ") : "",
          "float32", other_works ? "" : " (it cannot sum Half or BFloat16)", ": ", error);
    }
  }
  // 16-bit gradients (O2/O3 models) travel as they are where Gloo can sum
  // them and widened to float32 where it cannot (bfloat16 on LibTorch 1.13,
  // both on Debian's 2.14). Every rank probes the same types: its parameters'.
  for (const auto type : {at::kBFloat16, at::kHalf}) {
    bool has = false;
    for (const auto& p : impl->module->parameters()) {
      has = has || (p.requires_grad() && p.scalar_type() == type);
    }
    if (!has || cdt) continue;
    auto probe = torch::ones({1}, torch::TensorOptions().dtype(type).device(device));
    try {
      impl->group.all_reduce_sum(probe);
    } catch (const c10::Error&) {
      impl->unsummable.push_back(type);
    }
  }
  impl->build_buckets();
  for (size_t i = 0; i < impl->params.size(); ++i) {
    impl->hooks.push_back(impl->params[i].register_hook(
        [impl, i](const at::Tensor& grad) { impl->on_grad(static_cast<int64_t>(i), grad); }));
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  if (!impl_) return;
  for (size_t i = 0; i < impl_->params.size(); ++i) {
    impl_->params[i].remove_hook(impl_->hooks[i]);
  }
}

void DistributedDataParallel::synchronize() {
  impl_->synchronize();
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp) : ddp_(ddp) {
  ddp_.impl_->sync = false;
}
DistributedDataParallel::NoSyncGuard::~NoSyncGuard() {
  ddp_.impl_->sync = true;
}

int64_t DistributedDataParallel::bytes_communicated() const {
  return impl_->bytes;
}

std::vector<std::vector<int64_t>> DistributedDataParallel::bucket_layout() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& b : impl_->buckets) out.push_back(b.params);
  return out;
}

#else  // !AMPX_WITH_DIST

struct DistributedDataParallel::Impl {
  bool sync = true;
};

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module>, ProcessGroup,
                                                 DistributedDataParallelOptions) {
  TORCH_CHECK(false, "ampx::dist: this ampx was built without c10d/Gloo");
}
DistributedDataParallel::~DistributedDataParallel() = default;
void DistributedDataParallel::synchronize() {}
DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp) : ddp_(ddp) {}
DistributedDataParallel::NoSyncGuard::~NoSyncGuard() = default;
int64_t DistributedDataParallel::bytes_communicated() const {
  return 0;
}
std::vector<std::vector<int64_t>> DistributedDataParallel::bucket_layout() const {
  return {};
}

#endif

}  // namespace dist
}  // namespace ampx
