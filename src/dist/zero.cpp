// ZeroRedundancyOptimizer (ZeRO stage 1): sharded fp32 masters and optimizer
// state; reduce-scatter of gradients, all-gather of parameters.

#include "zero_impl.h"

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

namespace ampx {
namespace dist {

namespace {

// The single-group factory as a group factory: the local optimizer gets all
// shards as one list, its defaults for all.
ZeroRedundancyOptimizer::GroupOptimizerFactory over_all_shards(
    ZeroRedundancyOptimizer::OptimizerFactory make_optimizer) {
  if (!make_optimizer) return nullptr;
  return [make = std::move(make_optimizer)](std::vector<torch::optim::OptimizerParamGroup> groups) {
    std::vector<at::Tensor> shards;
    for (const auto& g : groups) {
      shards.insert(shards.end(), g.params().begin(), g.params().end());
    }
    return make(std::move(shards));
  };
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> params,
                                                 ProcessGroup group,
                                                 OptimizerFactory make_optimizer,
                                                 ZeroRedundancyOptimizerOptions options)
    : ZeroRedundancyOptimizer(
          std::vector<torch::optim::OptimizerParamGroup>{
              torch::optim::OptimizerParamGroup(std::move(params))},
          std::move(group), over_all_shards(std::move(make_optimizer)), std::move(options)) {}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(
    std::vector<torch::optim::OptimizerParamGroup> param_groups, ProcessGroup group,
    GroupOptimizerFactory make_optimizer, ZeroRedundancyOptimizerOptions options)
    : torch::optim::Optimizer(param_groups,
                              std::make_unique<ZeroRedundancyOptimizerOptions>(options)) {
  TORCH_CHECK(make_optimizer != nullptr, "ZeroRedundancyOptimizer: make_optimizer is empty");
  TORCH_CHECK(!options.max_grad_norm() || *options.max_grad_norm() > 0.0,
              "ZeroRedundancyOptimizer: max_grad_norm must be > 0, got ",
              options.max_grad_norm().value_or(0.0));
  TORCH_CHECK(options.bucket_bytes() > 0, "ZeroRedundancyOptimizer: bucket_bytes must be > 0, got ",
              options.bucket_bytes());
  impl_ = std::make_unique<Impl>(std::move(group), std::move(make_optimizer),
                                 options.max_grad_norm(), options.bucket_bytes());
  for (size_t g = 0; g < param_groups.size(); ++g) {
    for (const auto& p : param_groups[g].params()) {
      const auto dtype = p.scalar_type();
      TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                  "ZeroRedundancyOptimizer: parameter ", impl_->params.size(), " (group ", g,
                  ") is ", dtype, "; parameters must be float32, bfloat16 or float16");
      impl_->params.push_back(p);
      impl_->group_of.push_back(static_cast<int64_t>(g));
    }
    impl_->group_options.push_back(param_groups[g].has_options()
                                       ? param_groups[g].options().clone()
                                       : nullptr);
  }
  TORCH_CHECK(!impl_->params.empty(), "ZeroRedundancyOptimizer: no parameters");
  torch::NoGradGuard no_grad;
  if (options.broadcast_parameters()) {
    for (auto& p : impl_->params) {
      auto wire = as_wire(p.detach());
      impl_->group.broadcast(wire, 0);
    }
  }
  for (const auto& p : impl_->params) {
    impl_->snapshot.push_back(p.scalar_type() == at::kFloat ? p.detach().clone()
                                                            : at::Tensor());
  }
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

torch::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  impl_->step(at::Tensor(), at::Tensor());
  return loss;
}

void ZeroRedundancyOptimizer::step_scaled(const at::Tensor& grad_scale,
                                          const at::Tensor& found_inf) {
  impl_->step(grad_scale, found_inf);
}

torch::optim::Optimizer& ZeroRedundancyOptimizer::local_optimizer() {
  impl_->build();
  return *impl_->local;
}

const std::vector<at::Tensor>& ZeroRedundancyOptimizer::master_shards() {
  impl_->build();
  return impl_->masters;
}

int64_t ZeroRedundancyOptimizer::state_bytes() {
  impl_->build();
  int64_t total = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) total += t.numel() * static_cast<int64_t>(t.element_size());
  };
  for (const auto& m : impl_->masters) add(m);
  if (const auto* mixed = dynamic_cast<const optim::MixedPrecisionOptimizer*>(impl_->local.get())) {
    total += mixed->state_bytes();  // (no masters: the shards are fp32, their own masters)
  } else {
    // Another torch::optim optimizer: its state's size as it serializes.
    torch::serialize::OutputArchive archive;
    impl_->local->save(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    total += static_cast<int64_t>(bytes.str().size());
  }
  return total;
}

int64_t ZeroRedundancyOptimizer::bytes_communicated() const {
  return impl_->bytes;
}

c10::optional<double> ZeroRedundancyOptimizer::last_grad_norm() const {
  return impl_->last_norm;
}

}  // namespace dist
}  // namespace ampx
