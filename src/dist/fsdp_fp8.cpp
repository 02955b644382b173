// FullyShardedDataParallel's FP8 all-gather (fp8_all_gather, ampx/fsdp.h):
// the weights of a unit's FP8 layers cast on each rank's shard to the
// layer's codes with the scale of the whole weight, gathered a byte an
// element, and given to the layers to compute with.

#include "ampx/fp8/autocast.h"
#include "ampx/fp8/convert.h"
#include "ampx/fp8/linear.h"
#include "ampx/fp8/scaling.h"
#include "ampx/fsdp.h"

#include "fsdp_impl.h"

#include <torch/nn/modules/linear.h>
#include <torch/torch.h>

#include <memory>
#include <tuple>
#include <vector>

namespace ampx {
namespace dist {

#if defined(AMPX_WITH_DIST)

namespace fsdp {

namespace {

/// The weight role of `layer`'s scaling, where it scales whole tensors.
std::shared_ptr<fp8::TensorScaling> weight_role(torch::nn::Module& layer) {
  const auto scaling = fp8::scaling_of(layer);
  if (!scaling || scaling->recipe.is_block()) return nullptr;
  return scaling->weight;
}

}  // namespace

torch::nn::Module* fp8_layer_of(torch::nn::Module& owner, const at::Tensor& t) {
  if (!fp8::scaling_of(owner)) return nullptr;
  const c10::TensorImpl* weight = nullptr;
  if (const auto* linear = dynamic_cast<const fp8::LinearImpl*>(&owner)) {
    weight = linear->weight.unsafeGetTensorImpl();
  } else if (const auto* plain = dynamic_cast<const torch::nn::LinearImpl*>(&owner)) {
    weight = plain->weight.unsafeGetTensorImpl();
  }
  return weight == t.unsafeGetTensorImpl() ? &owner : nullptr;
}

bool codes_wanted(const Impl& impl, const Space& s) {
  if (!s.fp8 || !fp8::is_fp8_enabled()) return false;
  if (s.block) {  // still block-scaled, its weight in the formats its shards were cut for
    const auto scaling = fp8::scaling_of(*impl.params[static_cast<size_t>(s.params[0])].fp8_layer);
    if (!scaling || !scaling->recipe.is_block()) return false;
    const auto formats = fp8::block_weight_formats(scaling->recipe);
    return formats.forward == s.block->formats.forward &&
           formats.backward == s.block->formats.backward;
  }
  for (const int64_t i : s.params) {
    if (!weight_role(*impl.params[static_cast<size_t>(i)].fp8_layer)) return false;
  }
  return true;
}

bool gather_as_codes(const Impl& impl, const Unit& u, Space& s, bool forward) {
  if (!forward) return s.backward_codes.value_or(s.as_codes);
  const bool codes = codes_wanted(impl, s);
  if (at::GradMode::is_enabled()) {
    TORCH_CHECK(!s.backward_codes || *s.backward_codes == codes, "FullyShardedDataParallel: unit '",
                u.name, "' was gathered for a forward ", codes ? "outside" : "inside",
                " an FP8 region (its FP8 weights as ", codes ? "full-width values" : "codes",
                "), and is now called ", codes ? "inside" : "outside",
                " one before that forward's backward: one backward's forwards of a unit run "
                "all inside or all outside the FP8 region (a forward without backward: under "
                "torch::NoGradGuard)");
    s.backward_codes = codes;
  }
  return codes;
}

at::Tensor cast_shard(Impl& impl, Space& s) {
  torch::NoGradGuard no_grad;
  const auto n = static_cast<int64_t>(s.params.size());
  if (s.casts.empty()) {
    // Each whole weight's amax: the largest of its pieces' over the ranks.
    auto amax = at::zeros({n}, s.master.options());
    for (int64_t j = 0; j < n; ++j) {
      const auto& piece = impl.params[static_cast<size_t>(s.params[j])].piece;
      if (piece.numel() > 0) amax.narrow(0, j, 1).copy_(fp8::compute_amax(piece).reshape({1}));
    }
    impl.group.all_reduce_max(amax);
    for (int64_t j = 0; j < n; ++j) {
      const auto role = weight_role(*impl.params[static_cast<size_t>(s.params[j])].fp8_layer);
      Fp8Cast cast;
      cast.amax = amax.narrow(0, j, 1).clone();
      std::tie(cast.scale, cast.scale_inv) = role->scales_for(cast.amax);
      cast.format = role->format();
      s.casts.push_back(std::move(cast));
    }
  }
  auto codes = at::zeros({s.master.numel()}, s.master.options().dtype(at::kByte));
  for (int64_t j = 0; j < n; ++j) {
    const auto& p = impl.params[static_cast<size_t>(s.params[j])];
    if (p.piece.numel() == 0) continue;
    const auto& cast = s.casts[static_cast<size_t>(j)];
    codes.narrow(0, p.piece_offset, p.piece.numel())
        .copy_(fp8::quantize(p.piece, cast.format, cast.scale));
  }
  return codes;
}

void give_codes(Impl& impl, Space& s) {
  torch::NoGradGuard no_grad;
  for (size_t j = 0; j < s.params.size(); ++j) {
    auto& p = impl.params[static_cast<size_t>(s.params[j])];
    const auto& cast = s.casts[j];
    // The layer saves its codes for backward: they alias the gathered
    // storage (the gather before backward fills it again) with a version
    // counter of their own, which the gathers into s.codes do not move.
    std::vector<int64_t> strides(p.shape.size(), 1);
    for (size_t d = p.shape.size(); d-- > 1;) strides[d - 1] = strides[d] * p.shape[d];
    auto codes = at::empty({0}, s.codes.options());
    codes.set_(s.codes.storage(), s.codes.storage_offset() + p.offset, p.shape, strides);
    weight_role(*p.fp8_layer)->give_weight(p.tensor, codes, cast.scale, cast.scale_inv, cast.amax);
  }
}

void drop_codes(Impl& impl, Space& s) {
  for (const int64_t i : s.params) {
    // Also after a layer stopped being FP8: what it was given goes.
    const auto scaling = fp8::scaling_of(*impl.params[static_cast<size_t>(i)].fp8_layer);
    if (scaling && scaling->weight) scaling->weight->drop_given_weight();
    if (scaling) scaling->drop_given_block_weight();
  }
}

}  // namespace fsdp

#endif  // AMPX_WITH_DIST

}  // namespace dist
}  // namespace ampx
