#pragma once

// ZeroRedundancyOptimizer's insides (src/dist/zero.cpp: the steps;
// zero_checkpoint.cpp: its state): one flat space per param group and dtype,
// this rank's fp32 master shard of each, and the local optimizer over them.

#include "ampx/zero.h"

#include "ampx/optim/optimizer.h"

#include "../scaler/scale_math.h"
#include "model_check.h"
#include "process_group_impl.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

namespace ampx {
namespace dist {

// (A named namespace: Impl holds Spaces, and a type of an anonymous namespace
// in a member of a class with linkage is an error when unity builds merge
// this file into another.)
namespace zero_detail {

// The parameters of one param group and dtype, end to end, padded to
// world * shard.
struct Space {
  int64_t group = 0;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> params;   // indices into Impl::params
  std::vector<int64_t> offsets;  // each one's first element in the space
  int64_t numel = 0;             // unpadded
  int64_t shard = 0;             // elements per rank
};

inline std::string describe(const std::vector<Space>& spaces) {
  std::ostringstream s;
  for (size_t k = 0; k < spaces.size(); ++k) {
    s << (k ? ", " : "") << "group " << spaces[k].group << ": " << spaces[k].numel << " "
      << spaces[k].dtype;
  }
  return s.str();
}

}  // namespace zero_detail

using zero_detail::describe;
using zero_detail::Space;

struct ZeroRedundancyOptimizer::Impl {
  std::vector<at::Tensor> params;  // all groups', in order
  std::vector<int64_t> group_of;   // each param's group
  // Each group's options as given (null: none given, the local optimizer's defaults apply).
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> group_options;
  ProcessGroup group;
  GroupOptimizerFactory make_optimizer;
  c10::optional<double> max_grad_norm;
  c10::optional<double> last_norm;
  int64_t bucket_bytes = 0;
  std::vector<at::Tensor> snapshot;  // fp32 values at construction, until build()
  std::vector<Space> spaces;
  std::vector<at::Tensor> masters;  // fp32 [shard] per space: this rank's
  std::unique_ptr<torch::optim::Optimizer> local;
  int64_t bytes = 0;

  Impl(ProcessGroup g, GroupOptimizerFactory f, c10::optional<double> max_norm, int64_t bucket)
      : group(std::move(g)),
        make_optimizer(std::move(f)),
        max_grad_norm(max_norm),
        bucket_bytes(bucket) {}

  int64_t rank() const { return group.rank(); }
  int64_t world() const { return group.world_size(); }

  void build() {
    if (local) return;
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      const auto dtype = params[i].scalar_type();
      auto it = std::find_if(spaces.begin(), spaces.end(), [&](const Space& s) {
        return s.group == group_of[i] && s.dtype == dtype;
      });
      if (it == spaces.end()) {
        spaces.emplace_back();
        spaces.back().group = group_of[i];
        spaces.back().dtype = dtype;
        it = std::prev(spaces.end());
      }
      it->params.push_back(static_cast<int64_t>(i));
      it->offsets.push_back(it->numel);
      it->numel += params[i].numel();
    }
    check_same_layout_everywhere();
    for (auto& s : spaces) {
      s.shard = (s.numel + world() - 1) / world();
      const auto opts = params[s.params[0]].options();
      // This rank's slice of the space, from the fp32 snapshot where there is one.
      auto master = torch::zeros({s.shard}, opts.dtype(at::kFloat));
      const int64_t lo = rank() * s.shard, hi = lo + s.shard;
      for (size_t j = 0; j < s.params.size(); ++j) {
        const int64_t i = s.params[j], begin = s.offsets[j], n = params[i].numel();
        const int64_t a = std::max(lo, begin), b = std::min(hi, begin + n);
        if (a >= b) continue;
        const auto& snap = snapshot[i];
        const auto source = snap.defined() && snap.sizes() == params[i].sizes()
                                ? snap
                                : params[i].detach().to(at::kFloat);
        master.narrow(0, a - lo, b - a).copy_(source.reshape({-1}).narrow(0, a - begin, b - a));
      }
      masters.push_back(master);
    }
    snapshot.clear();
    std::vector<torch::optim::OptimizerParamGroup> shard_groups;
    for (size_t k = 0; k < spaces.size(); ++k) {
      const auto& options = group_options[static_cast<size_t>(spaces[k].group)];
      if (options) {
        shard_groups.emplace_back(std::vector<at::Tensor>{masters[k]}, options->clone());
      } else {
        shard_groups.emplace_back(std::vector<at::Tensor>{masters[k]});
      }
    }
    local = make_optimizer(std::move(shard_groups));
    TORCH_CHECK(local != nullptr, "ZeroRedundancyOptimizer: the optimizer factory returned null");
    if (const auto* mixed = dynamic_cast<const optim::MixedPrecisionOptimizer*>(local.get())) {
      TORCH_CHECK(!mixed->config().max_grad_norm, "ZeroRedundancyOptimizer: the local ",
                  mixed->name(),
                  " has max_grad_norm set, which would clip by the norm of this rank's shard "
                  "alone, not the global norm; leave it unset and set "
                  "ZeroRedundancyOptimizerOptions::max_grad_norm instead");
    }
  }

  // Every rank must shard the same parameters the same way.
  void check_same_layout_everywhere() {
    std::vector<double> mine{static_cast<double>(spaces.size())};
    for (const auto& s : spaces) {
      mine.push_back(static_cast<double>(s.group));
      mine.push_back(static_cast<double>(s.numel));
      mine.push_back(static_cast<double>(static_cast<int>(s.dtype)));
    }
    auto len = torch::tensor({static_cast<double>(mine.size())}, torch::kDouble);
    auto len_max = len.clone(), len_min = -len;
    group.all_reduce_max(len_max);
    group.all_reduce_max(len_min);
    bool same = len_max.item<double>() == -len_min.item<double>();
    if (same) {
      auto hi = torch::tensor(mine, torch::kDouble), lo = -hi;
      group.all_reduce_max(hi);
      group.all_reduce_max(lo);
      same = torch::equal(hi, -lo);
    }
    TORCH_CHECK(same, "ZeroRedundancyOptimizer: rank ", rank(),
                " has parameters (per group and dtype: ", describe(spaces),
                ") that differ from another rank's; every rank must pass the same parameters "
                "in the same groups, order and dtypes");
  }

  void check_dtypes() const {
    for (const auto& s : spaces) {
      for (const int64_t i : s.params) {
        TORCH_CHECK(params[i].scalar_type() == s.dtype, "ZeroRedundancyOptimizer: parameter ", i,
                    " is ", params[i].scalar_type(), " but was ", s.dtype,
                    " when the shards were made (first step or load()); cast the model "
                    "before that");
      }
    }
  }

  // A collective's elements per rank in a piece of space `s` whose
  // elements take `element_size` bytes: bucket_bytes over every rank.
  int64_t piece_elements(const Space& s, int64_t element_size) const {
    return std::min(s.shard, std::max<int64_t>(1, bucket_bytes / (element_size * world())));
  }

  // Copies elements [begin, begin + out.numel()) of space `s` from the
  // parameters' gradients into `out` (fp32): zeros for a parameter without
  // one (as in the optimizers) and for the padding.
  void pack_grads(const Space& s, int64_t begin, at::Tensor out) const {
    const int64_t end = begin + out.numel();
    if (end > s.numel) {
      const int64_t pad = std::max(begin, s.numel);
      out.narrow(0, pad - begin, end - pad).zero_();
    }
    for (size_t j = 0; j < s.params.size(); ++j) {
      const auto& p = params[s.params[j]];
      const int64_t a = std::max(begin, s.offsets[j]), b = std::min(end, s.offsets[j] + p.numel());
      if (a >= b) continue;
      auto slot = out.narrow(0, a - begin, b - a);
      const auto& g = p.grad();
      if (!g.defined()) {
        slot.zero_();
        continue;
      }
      TORCH_CHECK(!g.is_sparse(), "ZeroRedundancyOptimizer: parameter ", s.params[j],
                  " has a sparse gradient; only dense gradients are sharded");
      slot.copy_(g.reshape({-1}).narrow(0, a - s.offsets[j], b - a));
    }
  }

  // Copies `values`, elements [begin, begin + values.numel()) of space `s`,
  // into the parameters (the padding's go nowhere).
  void unpack_params(const Space& s, int64_t begin, const at::Tensor& values) {
    const int64_t end = begin + values.numel();
    for (size_t j = 0; j < s.params.size(); ++j) {
      auto p = params[s.params[j]].detach();
      const int64_t a = std::max(begin, s.offsets[j]), b = std::min(end, s.offsets[j] + p.numel());
      if (a >= b) continue;
      const auto part = values.narrow(0, a - begin, b - a);
      if (p.is_contiguous()) {
        p.view({-1}).narrow(0, a - s.offsets[j], b - a).copy_(part);
      } else {
        auto flat = p.contiguous().view({-1});
        flat.narrow(0, a - s.offsets[j], b - a).copy_(part);
        p.copy_(flat.view(p.sizes()));
      }
    }
  }

  // Each space's gradients reduce-scattered into this rank's fp32 shard of
  // them, a piece at a time: rank r's part of a piece is elements
  // [r shard + at, r shard + at + n) of the space, packed into an fp32
  // buffer of at most bucket_bytes, held only while the space is reduced.
  void reduce_gradients() {
    const double inv_world = 1.0 / static_cast<double>(world());
    for (size_t k = 0; k < spaces.size(); ++k) {
      auto& s = spaces[k];
      auto& shard_grad = masters[k].mutable_grad();
      if (!shard_grad.defined()) shard_grad = torch::empty_like(masters[k]);
      const int64_t most = piece_elements(s, static_cast<int64_t>(sizeof(float)));
      auto buffer = torch::empty({world() * most}, masters[k].options());
      for (int64_t at = 0; at < s.shard; at += most) {
        const int64_t n = std::min(most, s.shard - at);
        auto in = buffer.narrow(0, 0, world() * n);
        for (int64_t r = 0; r < world(); ++r) {
          pack_grads(s, r * s.shard + at, in.narrow(0, r * n, n));
        }
        auto out = shard_grad.narrow(0, at, n);
        group.reduce_scatter_sum(out, in);
        bytes += in.numel() * static_cast<int64_t>(sizeof(float));
      }
      shard_grad.mul_(inv_world);
    }
  }

  // clip_grad_norm_ over all ranks' shards (of the unscaled gradients).
  void clip_gradients(const at::Tensor& grad_scale) {
    std::vector<at::Tensor> grads;
    for (const auto& m : masters) grads.push_back(m.grad());
    const double unscale =
        grad_scale.defined() ? ampx::detail::inverse_scale(grad_scale).item<double>() : 1.0;
    last_norm = ampx::detail::clip_sharded_grad_norm(grads, group, *max_grad_norm, unscale);
  }

  // Each space's shards all-gathered in the parameters' dtype and copied
  // into the parameters, a piece at a time as reduce_gradients() goes.
  void gather_parameters() {
    for (size_t k = 0; k < spaces.size(); ++k) {
      auto& s = spaces[k];
      const int64_t size = static_cast<int64_t>(c10::elementSize(s.dtype));
      const int64_t most = piece_elements(s, size);
      auto mine = torch::empty({most}, masters[k].options().dtype(s.dtype));
      auto buffer = torch::empty({world() * most}, mine.options());
      for (int64_t at = 0; at < s.shard; at += most) {
        const int64_t n = std::min(most, s.shard - at);
        auto send = mine.narrow(0, 0, n);
        send.copy_(masters[k].narrow(0, at, n));  // round to nearest even, as the optimizers do
        auto gathered = buffer.narrow(0, 0, world() * n);
        group.all_gather(gathered, send);
        bytes += gathered.numel() * size;
        for (int64_t r = 0; r < world(); ++r) {
          unpack_params(s, r * s.shard + at, gathered.narrow(0, r * n, n));
        }
      }
    }
  }

  void step(const at::Tensor& grad_scale, const at::Tensor& found_inf) {
    build();
    check_dtypes();
    torch::NoGradGuard no_grad;
    if (found_inf.defined()) {
      const float local_flag = found_inf.item<float>();
      auto agreed = torch::full({1}, local_flag);
      group.all_reduce_max(agreed);
      TORCH_CHECK(agreed.item<float>() == local_flag, "ZeroRedundancyOptimizer: rank ", rank(),
                  "'s GradScaler found ", local_flag != 0.f ? "an" : "no",
                  " inf/NaN but another rank's did", local_flag != 0.f ? " not" : "",
                  "; make the scalers agree with ampx::dist::synchronize_found_inf(scaler, "
                  "group) so that all ranks skip the same steps");
      if (local_flag != 0.f) return;  // skipped everywhere: nothing changes
    }
    reduce_gradients();
    if (max_grad_norm) clip_gradients(grad_scale);
    if (auto* aware = dynamic_cast<ScalerAwareOptimizer*>(local.get())) {
      aware->step_scaled(grad_scale, found_inf.defined() ? found_inf : at::Tensor());
    } else {
      if (grad_scale.defined()) {
        const auto inv = ampx::detail::inverse_scale(grad_scale);
        for (auto& m : masters) m.mutable_grad().mul_(inv.to(m.device()));
      }
      local->step();
    }
    gather_parameters();
  }
};

}  // namespace dist
}  // namespace ampx
