// FullyShardedDataParallel's gather of block-scaled layers' weights as their
// codes and scales (fp8_all_gather, ampx/fsdp.h): each such weight is a
// space of its own whose rows are sharded in whole blocks, so that each rank
// quantizes its rows exactly as the whole weight's quantization has them;
// the ranks gather the codes (FP4 two to a byte) and scales in the parts
// the call needs (TE's FSDP2 gather of MXFP8 weights: the row-wise copy for
// a forward, the column-wise one for a backward), and the layer multiplies
// them (LinearScaling::give_block_weight).

#include "ampx/fp8/block.h"
#include "ampx/fp8/convert.h"
#include "ampx/fp8/scaling.h"
#include "ampx/fsdp.h"

#include "fsdp_impl.h"
#include "process_group_impl.h"

#include <ATen/ceil_div.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

namespace ampx {
namespace dist {

#if defined(AMPX_WITH_DIST)

namespace fsdp {

namespace {

/// Whether `format` packs its codes two to a byte on the wire.
bool packs_codes(const fp8::BlockFormat& format) {
  return format.element() == fp8::ElementFormat::kE2M1;
}

/// Makes b's part `part` in `format`: the whole weight's codes and scales
/// over every rank's rows (padding included), and the views of its real
/// rows the layer is given, made while the storage is there (a view's
/// bounds are checked when it is made); then frees their storage.
void make_part(BlockGather& b, BlockGather::Part part, const fp8::BlockFormat& format,
               int64_t world, const at::TensorOptions& options) {
  fp8::BlockTensor& whole = b.whole[part];
  whole.format = format;
  whole.codes = at::empty({world * b.shard_rows, b.cols}, options.dtype(at::kByte));
  const bool fp32_scales =
      format.rule() == fp8::ScaleRule::kFloat32 || format.rule() == fp8::ScaleRule::kFloat32Pow2;
  whole.scales = at::empty(
      {world * b.shard_rows / format.block_rows(), at::ceil_div(b.cols, format.block_cols())},
      options.dtype(fp32_scales ? at::kFloat : at::kByte));
  fp8::BlockTensor& given = b.given[part];
  given.format = format;
  given.codes = whole.codes.narrow(0, 0, b.rows);
  given.scales = whole.scales.narrow(0, 0, at::ceil_div(b.rows, format.block_rows()));
  release_storage(whole.codes);
  release_storage(whole.scales);
}

/// The parts a gather for `forward` (else for a backward) moves: a forward
/// the forward product's, and the input gradient's too where the unit is
/// kept to its backward (ZeRO-2) and gradients are recorded; a backward
/// the input gradient's.
std::vector<BlockGather::Part> parts_for(const Impl& impl, const BlockGather& b, bool forward) {
  if (!forward) return {b.formats.shared ? BlockGather::kForward : BlockGather::kBackward};
  std::vector<BlockGather::Part> parts{BlockGather::kForward};
  if (!b.formats.shared && !impl.options.reshard_after_forward() && at::GradMode::is_enabled()) {
    parts.push_back(BlockGather::kBackward);
  }
  return parts;
}

}  // namespace

bool is_block_scaled(torch::nn::Module& layer) {
  const auto scaling = fp8::scaling_of(layer);
  return scaling && scaling->recipe.is_block();
}

std::shared_ptr<BlockGather> block_gather_of(torch::nn::Module& layer, const at::Tensor& weight,
                                             int64_t world) {
  const auto scaling = fp8::scaling_of(layer);
  if (!scaling || !scaling->recipe.is_block() || weight.dim() != 2 || weight.numel() == 0) {
    return nullptr;
  }
  auto b = std::make_shared<BlockGather>();
  b->formats = fp8::block_weight_formats(scaling->recipe);
  b->rows = weight.size(0);
  b->cols = weight.size(1);
  // Whole blocks of both parts on every rank: blocks down the rows of
  // either format start at a multiple of the rows of both.
  const int64_t align = std::lcm(b->formats.forward.block_rows(), b->formats.backward.block_rows());
  b->shard_rows = at::round_up(at::ceil_div(b->rows, world), align);
  // Mostly padding (small weights, many ranks, FP8 blockwise's 128-row
  // blocks): codes would move, and the shards hold, more than the weight;
  // it stays in its unit's space, gathered in param_dtype.
  if (world * b->shard_rows > 2 * b->rows) return nullptr;
  make_part(*b, BlockGather::kForward, b->formats.forward, world, weight.options());
  if (!b->formats.shared) {
    make_part(*b, BlockGather::kBackward, b->formats.backward, world, weight.options());
  }
  return b;
}

bool block_parts_ready(const Impl&, const Space& s, bool forward) {
  const BlockGather& b = *s.block;
  if (forward) return b.held[BlockGather::kForward];
  return b.held[b.formats.shared ? BlockGather::kForward : BlockGather::kBackward];
}

void whole_amaxes(Impl& impl, Unit& u) {
  std::vector<Space*> wanting;
  for (auto& s : u.spaces) {
    if (s.block && s.as_codes && s.block->formats.forward.rule() == fp8::ScaleRule::kNvfp4 &&
        !s.block->global_amax) {
      wanting.push_back(&s);
    }
  }
  if (wanting.empty()) return;
  torch::NoGradGuard no_grad;
  // Per weight [amax of its shard, any NaN in it]; the max over the ranks.
  auto m = at::zeros({static_cast<int64_t>(wanting.size()), 2}, wanting.front()->master.options());
  for (size_t j = 0; j < wanting.size(); ++j) {
    const at::Tensor a = wanting[j]->master.abs();
    const auto row = static_cast<int64_t>(j);
    m[row][0].copy_(at::where(a.isnan(), at::zeros_like(a), a).max());  // inf stays inf
    m[row][1].copy_(a.isnan().any().to(at::kFloat));
  }
  impl.group.all_reduce_max(m);
  const auto host = m.cpu();
  for (size_t j = 0; j < wanting.size(); ++j) {
    const auto row = static_cast<int64_t>(j);
    const float amax = host[row][1].item<float>() > 0.0f ? std::numeric_limits<float>::quiet_NaN()
                                                         : host[row][0].item<float>();
    BlockGather& b = *wanting[j]->block;
    b.global_amax = amax;
    // Both parts' now: a forward saves the backward's before it is gathered.
    for (auto& given : b.given) given.global_amax = amax;
  }
}

void quantize_block_shard(Impl& impl, Space& s, bool forward) {
  BlockGather& b = *s.block;
  const auto parts = parts_for(impl, b, forward);  // before the guard: it reads the grad mode
  torch::NoGradGuard no_grad;
  const bool nvfp4 = b.formats.forward.rule() == fp8::ScaleRule::kNvfp4;
  TORCH_INTERNAL_ASSERT(!nvfp4 || b.global_amax, "NVFP4 block gather without the whole amax");
  const at::Tensor rows = s.master.view({b.shard_rows, b.cols});
  b.sends.clear();
  for (const auto part : parts) {
    const fp8::BlockFormat& format = b.whole[part].format;
    const fp8::BlockTensor q = fp8::BlockTensor::quantize(
        rows, format, c10::nullopt, nvfp4 ? c10::optional<float>(*b.global_amax) : c10::nullopt);
    const at::Tensor codes = q.codes.reshape({-1});
    b.sends.push_back(packs_codes(format) ? fp8::pack_fp4(codes) : codes);
    b.sends.push_back(q.scales.contiguous().reshape({-1}));
  }
  b.moving = parts;
}

void start_block_gather(Impl& impl, Space& s) {
  BlockGather& b = *s.block;
  torch::NoGradGuard no_grad;
  auto& pg = detail::ProcessGroupAccess::impl(impl.group);
  TORCH_INTERNAL_ASSERT(b.sends.size() == 2 * b.moving.size() && b.works.empty());
  for (size_t k = 0; k < b.moving.size(); ++k) {
    const auto part = b.moving[k];
    fp8::BlockTensor& whole = b.whole[part];
    // Rank r's rows land at rows [r S, (r+1) S) of the whole codes and at
    // its blocks' rows of the whole scales: their own tensors, no copy but
    // FP4's unpacking (its codes' storage made then).
    at::Tensor codes;
    if (packs_codes(whole.format)) {
      b.packed[part] = at::empty({whole.codes.numel() / 2}, whole.codes.options());
      codes = b.packed[part];
    } else {
      allocate_storage(whole.codes);
      codes = whole.codes.view({-1});
    }
    allocate_storage(whole.scales);
    b.held[part] = true;
    at::Tensor scales = whole.scales.view({-1});
    impl.gathered_bytes += size_in_bytes(codes) + size_in_bytes(scales);
    impl.bytes_communicated += size_in_bytes(codes) + size_in_bytes(scales);
    // b.sends stay alive until the gathers are done.
    b.works.push_back(pg.all_gather_async(codes, b.sends[2 * k]));
    b.works.push_back(pg.all_gather_async(scales, b.sends[2 * k + 1]));
  }
}

void finish_block_gather(Impl& impl, Space& s, bool forward) {
  torch::NoGradGuard no_grad;
  BlockGather& b = *s.block;
  auto& pg = detail::ProcessGroupAccess::impl(impl.group);
  for (const auto& work : b.works) pg.wait(work, "all-gather (block codes and scales)");
  b.works.clear();
  b.sends.clear();
  for (const auto part : b.moving) {
    at::Tensor& packed = b.packed[part];
    if (!packed.defined()) continue;
    fp8::BlockTensor& whole = b.whole[part];
    allocate_storage(whole.codes);
    impl.gathered_bytes += size_in_bytes(whole.codes);
    impl.peak_gathered_bytes = std::max(impl.peak_gathered_bytes, impl.gathered_bytes);
    whole.codes.view({-1}).copy_(fp8::unpack_fp4(packed));
    impl.gathered_bytes -= size_in_bytes(packed);
    packed = at::Tensor();
  }
  b.moving.clear();
  if (!forward) return;  // the layer saved its backward's part at its forward
  const auto& p = impl.params[static_cast<size_t>(s.params.front())];
  const auto backward = b.formats.shared ? BlockGather::kForward : BlockGather::kBackward;
  fp8::scaling_of(*p.fp8_layer)
      ->give_block_weight(p.tensor, b.given[BlockGather::kForward], b.given[backward]);
}

void release_block_codes(Impl& impl, Space& s) {
  BlockGather& b = *s.block;
  auto& pg = detail::ProcessGroupAccess::impl(impl.group);
  for (const auto& work : b.works) pg.wait(work, "all-gather (block codes and scales)");
  b.works.clear();  // never free memory in flight
  b.sends.clear();
  for (const auto part : {BlockGather::kForward, BlockGather::kBackward}) {
    fp8::BlockTensor& whole = b.whole[part];
    if (b.packed[part].defined()) {  // a gather waited for and never unpacked
      impl.gathered_bytes -= size_in_bytes(b.packed[part]);
      b.packed[part] = at::Tensor();
    } else if (b.held[part]) {
      release_storage(whole.codes);
      impl.gathered_bytes -= size_in_bytes(whole.codes);
    }
    if (!b.held[part]) continue;
    release_storage(whole.scales);
    impl.gathered_bytes -= size_in_bytes(whole.scales);
    b.held[part] = false;
  }
  b.moving.clear();
}

}  // namespace fsdp

#endif  // AMPX_WITH_DIST

}  // namespace dist
}  // namespace ampx
