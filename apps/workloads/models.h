#pragma once

// The networks ampx-train trains, written with LibTorch's C++ modules:
//
//   GPT gpt(GPTConfig{/*vocab=*/96, /*block=*/128, /*layers=*/4, /*heads=*/4, /*d=*/256});
//   auto logits = gpt->forward(tokens);     // tokens: int64 [B, T] -> fp [B, T, vocab]
//   MnistCNN cnn;  cnn->forward(images);    // fp [B, 1, 28, 28] -> fp [B, 10]
//   FashionMLP mlp; mlp->forward(images);   // fp [B, 784] -> fp [B, 10]
//
// The memory benchmark (bench/cpp/o2_memory.cpp) trains the same GPT.
//
// Each forward opens an ampx::debug::ModuleScopeGuard: once ampx-train has named
// the modules (ampx::debug::name_modules), the numerics diagnostics put the
// ops between the layers (gelu, softmax, the residual adds) in "blocks.2",
// "blocks.2.attn", ... A scope only names: the numbers are the same.

#include <ampx/autocast.h>
#include <ampx/checkpoint.h>
#include <ampx/debug/scope.h>
#include <ampx/detail/compat.h>
#include <ampx/fsdp.h>
#include <ampx/kernels.h>
#include <ampx/policy.h>

#include <torch/torch.h>
#include <torch/version.h>

#include <cmath>
#include <cstdint>
#include <string>

namespace ampx::train {

/// `linear` over the last dimension of `x` ([..., in] -> [..., out]) as one
/// addmm on a 2-D view. LibTorch's C++ Linear fuses the bias into the matrix
/// product only for 2-D inputs; on [B, T, in] it runs a matmul and then a
/// second pass over the output to add the bias (Python's nn.Linear does not).
inline torch::Tensor linear_2d(torch::nn::Linear& linear, const torch::Tensor& x) {
  auto sizes = x.sizes().vec();
  auto y = linear(x.reshape({-1, sizes.back()}));
  sizes.back() = y.size(1);
  return y.view(sizes);
}

/// Whether a linear layer of `weight` and `bias` on gelu(h) runs here as
/// ampx::wide_gelu_linear computes it:
/// in O2's forward region on a CPU whose 16-bit products are wide, where
/// GELU is ampx::mixed_gelu and the product wide. --recompute mlp then runs
/// only GELU again in backward, not the product (the same numbers).
inline bool mlp_tail_runs_wide(const torch::Tensor& h, const torch::Tensor& weight,
                               const torch::Tensor& bias) {
  const auto dtype = h.scalar_type();
  return ampx::mixed_gelu_is_fused(h) && weight.scalar_type() == dtype &&
         (!bias.defined() || bias.scalar_type() == dtype) &&
         ampx::is_autocast_enabled(torch::kCPU) && ampx::cpu_products_are_wide(dtype) &&
         ampx::get_cast_policy(torch::kCPU, "aten::gelu") ==
             c10::optional<ampx::CastPolicy>(ampx::CastPolicy::kFp32OutputsAsInput);
}

/// How gpt's attention runs on the CPU.
enum class GptAttention {
  /// ampx::scaled_dot_product_attention: one fused kernel each way, float32
  /// math, no T x T tensor (the default).
  kFused,
  /// The explicit ops a Python 1.13 user writes (and bench/python's model
  /// runs): matmul, masked_fill, softmax, matmul.
  kExplicit,
};

/// "fused" or "explicit" (ampx-train's --attention).
inline GptAttention gpt_attention_named(const std::string& name) {
  TORCH_CHECK(name == "fused" || name == "explicit",
              "gpt attention must be \"fused\" or \"explicit\", got \"", name, "\"");
  return name == "fused" ? GptAttention::kFused : GptAttention::kExplicit;
}

/// What gpt's and gpt-nn's blocks run again in backward instead of keeping
/// for it (ampx::checkpoint, ampx/checkpoint.h): the gradients are the same,
/// bit for bit.
enum class GptRecompute {
  /// Everything backward needs is kept (the default).
  kNone,
  /// The MLP's GELU and output product: GELU's output (4 d a token) is not
  /// kept; its input is. One more GELU a block each step, and one more
  /// [4 d -> d] product where the products are not wide (mlp_tail_runs_wide).
  kMlp,
  /// Whole blocks: only each block's input is kept. One more forward a step.
  kBlocks,
};

/// "none", "mlp" or "blocks" (ampx-train's --recompute).
inline GptRecompute gpt_recompute_named(const std::string& name) {
  TORCH_CHECK(name == "none" || name == "mlp" || name == "blocks",
              "gpt recompute must be \"none\", \"mlp\" or \"blocks\", got \"", name, "\"");
  if (name == "mlp") return GptRecompute::kMlp;
  return name == "blocks" ? GptRecompute::kBlocks : GptRecompute::kNone;
}

/// A character-level GPT: pre-norm transformer blocks, causal self-attention.
struct GPTConfig {
  int64_t vocab = 96;
  int64_t block = 128;  // context length T
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t d = 256;
  GptAttention attention = GptAttention::kFused;
  GptRecompute recompute = GptRecompute::kNone;
};

/// The attention paths gpt's forward can run, named in ampx-train's settings
/// and report beside the Python comparison's own (bench/python/ampx_models.py
/// runs the explicit ops): LibTorch's fused scaled_dot_product_attention
/// picks kernels by version and dtype (Debian's 2.14 runs bf16 on this CPU
/// through a flash kernel several times slower than these matrix products).
inline constexpr const char* kGptFusedAttention =
    "ampx::scaled_dot_product_attention, causal (fused CPU kernel, float32 math)";
inline constexpr const char* kGptAttention =
    "explicit matmul, masked_fill, softmax, matmul (no SDPA kernel)";

/// On CUDA with LibTorch 2.x, gpt's attention is LibTorch's fused causal
/// scaled_dot_product_attention (flash or memory-efficient kernels: the
/// T x T scores are never stored), as a Python user's would be.
#if AMPX_TORCH_AT_LEAST(2, 0)
#define AMPX_GPT_CUDA_SDPA 1
#else
#define AMPX_GPT_CUDA_SDPA 0
#endif
inline constexpr const char* kGptCudaAttention =
    "scaled_dot_product_attention, causal (LibTorch's fused kernels)";

/// The attention path gpt runs on `device`.
inline const char* gpt_attention(const torch::Device& device,
                                 GptAttention attention = GptAttention::kFused) {
  if (device.is_cuda()) return AMPX_GPT_CUDA_SDPA ? kGptCudaAttention : kGptAttention;
  return attention == GptAttention::kFused ? kGptFusedAttention : kGptAttention;
}

struct CausalSelfAttentionImpl : torch::nn::Module {
  explicit CausalSelfAttentionImpl(const GPTConfig& c)
      : heads(c.heads), d(c.d), fused(c.attention == GptAttention::kFused) {
    TORCH_CHECK(c.heads > 0 && c.d % c.heads == 0, "GPT: d (", c.d,
                ") must be a multiple of heads (", c.heads, ")");
    qkv = register_module("qkv", torch::nn::Linear(c.d, 3 * c.d));
    proj = register_module("proj", torch::nn::Linear(c.d, c.d));
    mask =
        register_buffer("mask", torch::ones({c.block, c.block}, torch::kBool).tril().logical_not());
  }
  torch::Tensor forward(const torch::Tensor& x) {  // x: [B, T, d]
    ampx::debug::ModuleScopeGuard scope(*this);
    const auto B = x.size(0), T = x.size(1), hd = d / heads;
    auto parts =
        linear_2d(qkv, x).view({B, T, 3, heads, hd}).permute({2, 0, 3, 1, 4});  // [3, B, H, T, hd]
    // unbind: one backward that stacks the three gradients; three selects
    // would each zero-fill and copy a whole [3, B, H, T, hd] gradient.
    const auto qkv_parts = parts.unbind(0);
    const auto &q = qkv_parts[0], &k = qkv_parts[1], &v = qkv_parts[2];
#if AMPX_GPT_CUDA_SDPA
    if (x.is_cuda()) {
      const auto y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
      return linear_2d(proj, y.transpose(1, 2).reshape({B, T, d}));
    }
#endif
    if (fused && x.device().is_cpu()) {  // y: [B, H, T, hd] over [B, T, H, hd] memory
      const auto y = ampx::scaled_dot_product_attention(q, k, v, /*is_causal=*/true);
      return linear_2d(proj, y.transpose(1, 2).reshape({B, T, d}));
    }
    auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
    att = att.masked_fill(mask.slice(0, 0, T).slice(1, 0, T), -INFINITY);
    att = torch::softmax(att, -1);
    auto y = torch::matmul(att, v).transpose(1, 2).reshape({B, T, d});  // [B, T, d]
    return linear_2d(proj, y);
  }
  int64_t heads, d;
  bool fused;
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  torch::Tensor mask;
};
TORCH_MODULE(CausalSelfAttention);

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const GPTConfig& c) : recompute_mlp(c.recompute == GptRecompute::kMlp) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d})));
    attn = register_module("attn", CausalSelfAttention(c));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d})));
    fc = register_module("fc", torch::nn::Linear(c.d, 4 * c.d));
    out = register_module("out", torch::nn::Linear(4 * c.d, c.d));
  }
  torch::Tensor forward(torch::Tensor x) {
    ampx::debug::ModuleScopeGuard scope(*this);
    x = x + attn(ln1(x));
    const auto h = linear_2d(fc, ln2(x));
    if (!recompute_mlp) return x + linear_2d(out, torch::gelu(h));
    if (mlp_tail_runs_wide(h, out->weight, out->bias))
      return x + ampx::wide_gelu_linear(h, out->weight, out->bias);
    return x + ampx::checkpoint(
                   [this](const torch::Tensor& t) { return linear_2d(out, torch::gelu(t)); }, h);
  }
  bool recompute_mlp;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::Linear fc{nullptr}, out{nullptr};
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(const GPTConfig& c) : recompute_blocks(c.recompute == GptRecompute::kBlocks) {
    tok = register_module("tok", torch::nn::Embedding(c.vocab, c.d));
    pos = register_parameter("pos", torch::randn({c.block, c.d}) * 0.02);
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(Block(c));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d})));
    head = register_module("head", torch::nn::Linear(c.d, c.vocab));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {  // int64 [B, T] -> logits [B, T, vocab]
    ampx::debug::ModuleScopeGuard scope(*this);
    auto x = tok(tokens) + pos.slice(0, 0, tokens.size(1));
    for (const auto& block : *blocks) {  // each a unit of its own under ampx-train --shard full
      auto* b = block->as<Block>();
      x = recompute_blocks
              ? ampx::checkpoint([b](const torch::Tensor& h) { return b->forward(h); }, x)
              : ampx::dist::sharded_forward(b, x);
    }
    return linear_2d(head, ln_f(x));
  }
  bool recompute_blocks;
  torch::nn::Embedding tok{nullptr};
  torch::Tensor pos;
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(GPT);

/// Two conv + batch-norm stages and a two-layer classifier (about 420k
/// parameters); batch norm makes O2's fp32-norm rule matter.
struct MnistCNNImpl : torch::nn::Module {
  MnistCNNImpl() {
    using namespace torch::nn;
    conv1 = register_module("conv1", Conv2d(Conv2dOptions(1, 32, 3).padding(1)));
    bn1 = register_module("bn1", BatchNorm2d(32));
    conv2 = register_module("conv2", Conv2d(Conv2dOptions(32, 64, 3).padding(1)));
    bn2 = register_module("bn2", BatchNorm2d(64));
    fc1 = register_module("fc1", Linear(64 * 7 * 7, 128));
    fc2 = register_module("fc2", Linear(128, 10));
  }
  torch::Tensor forward(const torch::Tensor& images) {  // [B, 1, 28, 28] -> [B, 10]
    ampx::debug::ModuleScopeGuard scope(*this);
    // ampx's pool: LibTorch's bit for bit, without its NCHW kernel's branch
    // mispredictions (ampx/kernels/pooling.h).
    auto x = ampx::max_pool2d(torch::relu(bn1(conv1(images))), 2);  // [B, 32, 14, 14]
    x = ampx::max_pool2d(torch::relu(bn2(conv2(x))), 2);            // [B, 64, 7, 7]
    return fc2(torch::relu(fc1(x.flatten(1))));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(MnistCNN);

/// 784-512-256-10 with ReLU (about 535k parameters).
struct FashionMLPImpl : torch::nn::Module {
  FashionMLPImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(784, 512));
    fc2 = register_module("fc2", torch::nn::Linear(512, 256));
    fc3 = register_module("fc3", torch::nn::Linear(256, 10));
  }
  torch::Tensor forward(const torch::Tensor& images) {  // [B, 784] -> [B, 10]
    ampx::debug::ModuleScopeGuard scope(*this);
    return fc3(torch::relu(fc2(torch::relu(fc1(images)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(FashionMLP);

}  // namespace ampx::train
