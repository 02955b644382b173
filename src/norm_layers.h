#pragma once

// Which modules are norm layers, kept in fp32 by O2 (amp.cpp) and by
// FullyShardedDataParallelOptions::keep_norms_fp32 (dist/fsdp.cpp).

#include <torch/nn.h>

namespace ampx {
namespace detail {

inline bool is_norm_layer(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m) ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m) ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m) ||
         dynamic_cast<const torch::nn::InstanceNorm1dImpl*>(&m) ||
         dynamic_cast<const torch::nn::InstanceNorm2dImpl*>(&m) ||
         dynamic_cast<const torch::nn::InstanceNorm3dImpl*>(&m) ||
         dynamic_cast<const torch::nn::LayerNormImpl*>(&m) ||
         dynamic_cast<const torch::nn::GroupNormImpl*>(&m);
}

}  // namespace detail
}  // namespace ampx
