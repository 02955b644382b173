"""ampx-train's three networks (apps/workloads/models.h) in Python, layer for layer.

The modules are named as the C++ ones register them, so a state dict exported
from LibTorch (named_parameters() + named_buffers()) loads here with
strict=True, and the forward passes call the same ATen ops in the same order
(matmul, masked_fill, softmax, layer_norm, gelu, conv2d, batch_norm,
max_pool2d). Construction draws from torch's global generator in the C++ order
as well: after torch.manual_seed(s), GPT / MnistCNN / FashionMLP hold the same
initial weights as ampx-train's models built after torch::manual_seed(s)
(bench/python/parity_check.py checks all of this against LibTorch).

One layer differs by design: Python's nn.Linear runs aten::linear, LibTorch's
C++ torch::nn::Linear does not for inputs of 3 or more dimensions (the GPT's):
torch/nn/functional/linear.h computes input.matmul(weight.t()) and then adds
the bias in place. Same math, but under bf16 autocast the C++ frontend rounds
the product to bf16 before adding the fp32 bias, where aten::linear adds a
bf16 bias inside the GEMM and rounds once: the GPT's bf16 loss differs in the
5th digit. linear="torch" (the default) is what a Python user writes and what
the benchmark compares against; linear="libtorch" computes what the C++
frontend computes (bit for bit on the checked workloads), for the parity test.

    model = build_model("gpt", vocab=96)               # tokens int64 [B, T] -> logits [B, T, vocab]
    loss = cross_entropy(model(tokens), targets)       # fp32 mean over B * T positions
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

WORKLOADS = ("gpt", "gpt-nn", "mnist-cnn", "fashion-mlp")
# The workloads that train the GPT shape on Moby Dick's text.
GPT_WORKLOADS = ("gpt", "gpt-nn")

# apps/ampx-train/cli/config.h: the gpt shape flags' defaults.
GPT_DEFAULTS = {"block_size": 128, "layers": 4, "d_model": 256, "heads": 4}

LINEARS = ("torch", "libtorch")


class LibTorchLinear(nn.Linear):
    """nn.Linear computed as ampx-train's C++ models compute it: one addmm on a
    2-D view of the input (models.h's linear_2d; LibTorch's C++ Linear alone
    would run matmul and then add the bias in place for 3-D inputs)."""

    def forward(self, x):
        y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight.t())
        return y.view(*x.shape[:-1], y.shape[-1])


# The attention path CausalSelfAttention runs: the same ops, named the same
# way, as ampx-train's gpt (models.h's kGptAttention); not PyTorch's fused
# scaled_dot_product_attention, whose CPU kernels differ by version and dtype.
ATTENTION = "explicit matmul, masked_fill, softmax, matmul (no SDPA kernel)"
# On CUDA both sides run PyTorch's fused causal kernel (models.h's
# kGptCudaAttention), as a Python user's GPT would.
CUDA_ATTENTION = "scaled_dot_product_attention, causal (LibTorch's fused kernels)"


# gpt-nn's attention: nn.MultiheadAttention's own ops (models.h's kGptNNAttention).
NN_ATTENTION = "nn.MultiheadAttention (causal attn_mask, need_weights=False)"


def attention_on(device, workload="gpt"):
    """The attention path the workload's GPT runs on `device` ("cpu" or "cuda")."""
    if workload == "gpt-nn":
        return NN_ATTENTION
    return CUDA_ATTENTION if device == "cuda" else ATTENTION


class CausalSelfAttention(nn.Module):
    def __init__(self, block, heads, d, linear=nn.Linear):
        super().__init__()
        if heads <= 0 or d % heads != 0:
            raise ValueError(f"GPT: d ({d}) must be a multiple of heads ({heads})")
        self.heads, self.d = heads, d
        self.qkv = linear(d, 3 * d)
        self.proj = linear(d, d)
        # True above the diagonal: the future a position may not attend to.
        self.register_buffer("mask", torch.ones(block, block, dtype=torch.bool).tril().logical_not())

    def forward(self, x):  # x: [B, T, d]
        B, T = x.size(0), x.size(1)
        hd = self.d // self.heads
        parts = self.qkv(x).view(B, T, 3, self.heads, hd).permute(2, 0, 3, 1, 4)  # [3, B, H, T, hd]
        q, k, v = parts.unbind(0)  # one backward (a stack), as models.h
        if x.is_cuda:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(B, T, self.d))
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # [B, H, T, T]
        att = att.masked_fill(self.mask[:T, :T], float("-inf"))
        att = torch.softmax(att, -1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(B, T, self.d)  # [B, T, d]
        return self.proj(y)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + MLP(ln2(x)) with exact GELU."""

    def __init__(self, block, heads, d, linear=nn.Linear):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(block, heads, d, linear)
        self.ln2 = nn.LayerNorm(d)
        self.fc = linear(d, 4 * d)
        self.out = linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Character-level GPT: token embedding + learned positions (N(0, 0.02)), blocks, ln_f, head."""

    def __init__(self, vocab=96, block=128, layers=4, heads=4, d=256, linear=nn.Linear):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(block, d) * 0.02)
        self.blocks = nn.ModuleList([Block(block, heads, d, linear) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = linear(d, vocab)

    def forward(self, tokens):  # int64 [B, T] -> logits [B, T, vocab]
        x = self.tok(tokens) + self.pos[: tokens.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class NNBlock(nn.Module):
    """A pre-norm transformer block as most Python users write one, from torch.nn's
    stock modules: nn.MultiheadAttention (batch_first, the causal mask as attn_mask,
    need_weights=False), an nn.Sequential MLP with nn.GELU, nn.LayerNorm."""

    def __init__(self, heads, d):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPTNN(nn.Module):
    """gpt-nn: the GPT's shape and data written with NNBlock, the second model of the
    comparison (models.h's GPTNN, its C++ twin), so that it does not rest on one
    hand-matched model."""

    def __init__(self, vocab=96, block=128, layers=4, heads=4, d=256):
        super().__init__()
        if heads <= 0 or d % heads != 0:
            raise ValueError(f"GPT: d ({d}) must be a multiple of heads ({heads})")
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(block, d) * 0.02)
        self.blocks = nn.ModuleList([NNBlock(heads, d) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        # -inf above the diagonal (the future a position may not attend to), 0
        # elsewhere: nn.Transformer.generate_square_subsequent_mask's float mask.
        self.register_buffer("mask", torch.full((block, block), float("-inf")).triu(1))

    def forward(self, tokens):  # int64 [B, T] -> logits [B, T, vocab]
        T = tokens.size(1)
        x = self.tok(tokens) + self.pos[:T]
        mask = self.mask[:T, :T]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


class MnistCNN(nn.Module):
    """Two conv + batch-norm stages and a two-layer classifier (about 420k parameters)."""

    def __init__(self, linear=nn.Linear):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(64)
        self.fc1 = linear(64 * 7 * 7, 128)
        self.fc2 = linear(128, 10)

    def forward(self, images):  # [B, 1, 28, 28] -> [B, 10]
        x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(images))), 2)  # [B, 32, 14, 14]
        x = torch.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)  # [B, 64, 7, 7]
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class FashionMLP(nn.Module):
    """784-512-256-10 with ReLU (about 535k parameters)."""

    def __init__(self, linear=nn.Linear):
        super().__init__()
        self.fc1 = linear(784, 512)
        self.fc2 = linear(512, 256)
        self.fc3 = linear(256, 10)

    def forward(self, images):  # [B, 784] -> [B, 10]
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(images)))))


def build_model(workload, vocab=96, block_size=128, layers=4, heads=4, d_model=256, linear="torch"):
    """A freshly initialised model from torch's global generator, as Workload::build does.

    linear: "torch" (nn.Linear, aten::linear) or "libtorch" (LibTorchLinear, the C++ frontend's ops).
    """
    if linear not in LINEARS:
        raise ValueError(f"unknown linear '{linear}'; expected one of {', '.join(LINEARS)}")
    cls = LibTorchLinear if linear == "libtorch" else nn.Linear
    if workload == "gpt":
        return GPT(vocab=vocab, block=block_size, layers=layers, heads=heads, d=d_model, linear=cls)
    if workload == "gpt-nn":  # stock modules only: `linear` does not apply
        return GPTNN(vocab=vocab, block=block_size, layers=layers, heads=heads, d=d_model)
    if workload == "mnist-cnn":
        return MnistCNN(linear=cls)
    if workload == "fashion-mlp":
        return FashionMLP(linear=cls)
    raise ValueError(f"unknown workload '{workload}'; expected one of {', '.join(WORKLOADS)}")


def cross_entropy(logits, target):
    """workloads.cpp's loss: mean cross entropy over every position, computed in fp32.

    gpt: logits [B, T, vocab], target int64 [B, T]; images: logits [B, 10], target [B].
    """
    classes = logits.size(-1)
    return F.cross_entropy(logits.reshape(-1, classes).float(), target.reshape(-1))
