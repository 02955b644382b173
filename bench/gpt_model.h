#pragma once

// A character-level GPT (pre-norm transformer, causal self-attention) written
// with LibTorch's C++ modules: the model the memory benchmark trains, and the
// shape of ampx-train's `gpt` workload.
//
//   GPT gpt(GPTConfig{/*vocab=*/96, /*block=*/128, /*layers=*/4, /*heads=*/8, /*d=*/256});
//   auto logits = gpt->forward(tokens);            // tokens: int64 [B, T]

#include <torch/torch.h>

#include <cmath>

namespace ampx_bench {

struct GPTConfig {
  int64_t vocab = 96;
  int64_t block = 128;
  int64_t layers = 4;
  int64_t heads = 8;
  int64_t d = 256;
};

struct CausalSelfAttentionImpl : torch::nn::Module {
  explicit CausalSelfAttentionImpl(const GPTConfig& c) : heads(c.heads), d(c.d) {
    qkv = register_module("qkv", torch::nn::Linear(c.d, 3 * c.d));
    proj = register_module("proj", torch::nn::Linear(c.d, c.d));
    mask =
        register_buffer("mask", torch::ones({c.block, c.block}, torch::kBool).tril().logical_not());
  }
  torch::Tensor forward(const torch::Tensor& x) {  // x: [B, T, d]
    const auto B = x.size(0), T = x.size(1), hd = d / heads;
    auto parts = qkv(x).view({B, T, 3, heads, hd}).permute({2, 0, 3, 1, 4});  // [3, B, H, T, hd]
    auto q = parts[0], k = parts[1], v = parts[2];
    auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
    att = att.masked_fill(mask.slice(0, 0, T).slice(1, 0, T), -INFINITY);
    att = torch::softmax(att, -1);
    auto y = torch::matmul(att, v).transpose(1, 2).reshape({B, T, d});  // [B, T, d]
    return proj(y);
  }
  int64_t heads, d;
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  torch::Tensor mask;
};
TORCH_MODULE(CausalSelfAttention);

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const GPTConfig& c) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d})));
    attn = register_module("attn", CausalSelfAttention(c));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d})));
    fc = register_module("fc", torch::nn::Linear(c.d, 4 * c.d));
    out = register_module("out", torch::nn::Linear(4 * c.d, c.d));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn(ln1(x));
    return x + out(torch::gelu(fc(ln2(x))));
  }
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::Linear fc{nullptr}, out{nullptr};
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(const GPTConfig& c) {
    tok = register_module("tok", torch::nn::Embedding(c.vocab, c.d));
    pos = register_parameter("pos", torch::randn({c.block, c.d}) * 0.02);
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(Block(c));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d})));
    head = register_module("head", torch::nn::Linear(c.d, c.vocab));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {  // int64 [B, T] -> logits [B, T, vocab]
    auto x = tok(tokens) + pos.slice(0, 0, tokens.size(1));
    for (const auto& block : *blocks) x = block->as<Block>()->forward(x);
    return head(ln_f(x));
  }
  torch::nn::Embedding tok{nullptr};
  torch::Tensor pos;
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(GPT);

}  // namespace ampx_bench
