#pragma once

// gpt-nn: ampx-train's GPT written the way most users write one, from
// LibTorch's stock modules and nothing hand-made: torch::nn::MultiheadAttention
// with the causal mask as attn_mask (need_weights false), an MLP of
// Sequential(Linear, GELU, Linear), LayerNorm, and Linear layers applied to
// 3-D activations as they come.
//
//   GPTNN model(GPTConfig{/*vocab=*/96});        // tokens int64 [B, T] -> logits [B, T, vocab]
//
// bench/python/ampx_models.py's GPTNN is its twin, module for module (the
// same parameter names, and the same initial weights after the same seed),
// so that the Python comparison does not rest on one hand-matched model
// (gpt's). The one difference is layout: Python's nn.MultiheadAttention
// takes batch_first=True, LibTorch's C++ module only [T, B, d], so this one
// transposes around it (Python's transposes inside). Under ampx's policies it
// runs whatever the modules run: its attention is MultiheadAttention's own
// bmm, masked_fill, softmax and bmm (ampx::scaled_dot_product_attention is
// not called by any stock module).

#include "models.h"

#include <ampx/checkpoint.h>
#include <ampx/debug/scope.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace ampx::train {

/// gpt-nn's attention path, named in ampx-train's settings and report.
inline constexpr const char* kGptNNAttention =
    "nn.MultiheadAttention (causal attn_mask, need_weights=False)";

struct NNBlockImpl : torch::nn::Module {
  explicit NNBlockImpl(const GPTConfig& c) : recompute_mlp(c.recompute == GptRecompute::kMlp) {
    using namespace torch::nn;
    TORCH_CHECK(c.heads > 0 && c.d % c.heads == 0, "GPT: d (", c.d,
                ") must be a multiple of heads (", c.heads, ")");
    ln1 = register_module("ln1", LayerNorm(LayerNormOptions({c.d})));
    attn = register_module("attn", MultiheadAttention(MultiheadAttentionOptions(c.d, c.heads)));
    ln2 = register_module("ln2", LayerNorm(LayerNormOptions({c.d})));
    // One statement each: the weights are drawn in Python's order (a call's
    // arguments are constructed in an unspecified order).
    Linear fc(c.d, 4 * c.d);
    Linear out(4 * c.d, c.d);
    mlp = register_module("mlp", Sequential(fc, GELU(), out));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& mask) {  // x: [B, T, d]
    ampx::debug::ModuleScopeGuard scope(*this);
    const auto h = ln1(x).transpose(0, 1);  // [T, B, d]
    const auto a = std::get<0>(attn->forward(h, h, h, /*key_padding_mask=*/{},
                                             /*need_weights=*/false, mask));
    x = x + a.transpose(0, 1);
    if (!recompute_mlp) return x + mlp->forward(ln2(x));
    // The Sequential's GELU (and output layer, where products are not wide)
    // run again in backward.
    const auto fc = mlp[0]->as<torch::nn::Linear>()->forward(ln2(x));
    const auto* out = mlp[2]->as<torch::nn::Linear>();
    if (mlp_tail_runs_wide(fc, out->weight, out->bias)) {
      // As LibTorch's C++ Linear computes a 3-D input: the product, then
      // the bias added in place (a second rounding).
      auto y = ampx::wide_gelu_linear(fc, out->weight);
      if (out->bias.defined()) y += out->bias;
      return x + y;
    }
    return x + ampx::checkpoint(
                   [this](const torch::Tensor& t) {
                     return mlp[2]->as<torch::nn::Linear>()->forward(
                         mlp[1]->as<torch::nn::GELU>()->forward(t));
                   },
                   fc);
  }
  bool recompute_mlp;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::MultiheadAttention attn{nullptr};
  torch::nn::Sequential mlp{nullptr};
};
TORCH_MODULE(NNBlock);

struct GPTNNImpl : torch::nn::Module {
  explicit GPTNNImpl(const GPTConfig& c) : recompute_blocks(c.recompute == GptRecompute::kBlocks) {
    tok = register_module("tok", torch::nn::Embedding(c.vocab, c.d));
    pos = register_parameter("pos", torch::randn({c.block, c.d}) * 0.02);
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(NNBlock(c));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d})));
    head = register_module("head", torch::nn::Linear(c.d, c.vocab));
    // -inf above the diagonal (the future a position may not attend to), 0
    // elsewhere: nn.Transformer.generate_square_subsequent_mask's float mask,
    // which both languages' MultiheadAttention add to the scores alike.
    mask = register_buffer("mask", torch::full({c.block, c.block}, -INFINITY).triu(1));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {  // int64 [B, T] -> logits [B, T, vocab]
    ampx::debug::ModuleScopeGuard scope(*this);
    const int64_t T = tokens.size(1);
    auto x = tok(tokens) + pos.slice(0, 0, T);
    const auto causal = mask.slice(0, 0, T).slice(1, 0, T);
    for (const auto& block : *blocks) {  // each a unit of its own under ampx-train --shard full
      auto* b = block->as<NNBlock>();
      x = recompute_blocks
              ? ampx::checkpoint(
                    [b, causal](const torch::Tensor& h) { return b->forward(h, causal); }, x)
              : ampx::dist::sharded_forward(b, x, causal);
    }
    return head(ln_f(x));
  }
  bool recompute_blocks;
  torch::nn::Embedding tok{nullptr};
  torch::Tensor pos;
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
  torch::Tensor mask;
};
TORCH_MODULE(GPTNN);

}  // namespace ampx::train
