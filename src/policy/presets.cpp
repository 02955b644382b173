// Cast-policy presets: PyTorch's lists (no ampx policies) and Apex O1's.

#include "ampx/policy.h"

#include "registry.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace ampx {
namespace {

// Apex O1 (apex/amp/lists/{torch,functional}_overrides.py), by ATen name.
// Python-level functions map to the ATen ops they call: F.interpolate to
// upsample_*, F.cross_entropy to cross_entropy_loss. Python-only composites
// without an op of their own (softmin, normalize, local_response_norm,
// multilabel_soft_margin_loss) reach the ops listed here anyway.
const char* const kApexLowerPrecision[] = {
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_tbc", "prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv", "linear",
    // Apex lists bmm, baddbmm, addbmm as fp16 for CUDA >= 9.1.
    "addbmm", "baddbmm", "bmm"};

const char* const kApexFp32[] = {
    // pointwise
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus",
    // reductions
    "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var", "renorm",
    // softmax, normalization
    "softmax", "log_softmax", "layer_norm", "group_norm", "cosine_similarity",
    // F.interpolate
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
    "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d",
    // losses
    "poisson_nll_loss", "cosine_embedding_loss", "cross_entropy_loss", "hinge_embedding_loss",
    "kl_div", "l1_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "multi_margin_loss", "nll_loss", "nll_loss2d", "nll_loss_nd",
    "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss",
    "triplet_margin_loss"};

// CASTS and SEQUENCE_CASTS without the elementwise ones (see policy.h).
const char* const kApexPromote[] = {"addcdiv",  "addcmul", "atan2", "cross",
                                    "bilinear", "dot",     "cat",   "stack"};

bool registered(const std::string& op) {
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name == op) return true;
  }
  return false;
}

}  // namespace

std::vector<std::pair<std::string, CastPolicy>> cast_policy_preset(CastPolicyPreset preset) {
  std::vector<std::pair<std::string, CastPolicy>> out;
  if (preset == CastPolicyPreset::kPyTorch) return out;
  auto add = [&](const auto& names, CastPolicy policy) {
    for (const char* name : names) {
      std::string op = std::string("aten::") + name;
      if (registered(op)) out.emplace_back(std::move(op), policy);
    }
  };
  add(kApexLowerPrecision, CastPolicy::kLowerPrecision);
  add(kApexFp32, CastPolicy::kFp32);
  add(kApexPromote, CastPolicy::kPromote);
  return out;
}

void apply_cast_policy_preset(c10::DeviceType device_type, CastPolicyPreset preset) {
  reset_all_cast_policies(device_type);
  for (const auto& p : cast_policy_preset(preset)) set_cast_policy(device_type, p.first, p.second);
}

CastPolicyPresetGuard::CastPolicyPresetGuard(c10::DeviceType device_type, CastPolicyPreset preset) {
  detail::autocast_key(device_type, "CastPolicyPresetGuard");
  std::vector<std::pair<c10::OperatorName, c10::optional<detail::PolicyEntry>>> changes;
  if (preset == CastPolicyPreset::kPyTorch) {
    for (auto& name : detail::ops_with_policy(device_type)) {
      changes.emplace_back(std::move(name), c10::nullopt);
    }
  } else {
    for (const auto& p : cast_policy_preset(preset)) {
      for (auto& name : detail::resolve_op(p.first, "CastPolicyPresetGuard")) {
        changes.emplace_back(std::move(name), detail::PolicyEntry{p.second, false});
      }
    }
  }
  saved_ = detail::set_policies(device_type, changes);
}

CastPolicyPresetGuard::~CastPolicyPresetGuard() {
  detail::restore_policies(*saved_);
}

}  // namespace ampx
