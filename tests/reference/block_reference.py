#!/usr/bin/env python3
"""The block-scaled recipes torchao does not cover, written here from their
published formulas (../shared/research/low-precision-formats.md, sections
1.4-1.6), independently of ampx's C++: the reference of
tests/fp8/block/fp8_block_recipe_test.cpp.

  block_reference.py generate OUT_DIR

  - NVFP4 as Transformer Engine computes it: S_enc = min(448*6 / global_amax,
    FLT_MAX) (1 for a zero amax), block scale e4m3(block_amax * (S_enc *
    (1/6))) rounded once with no lower clamp, elements
    e2m1(x * min(1 / (scale * (1 / S_enc)), FLT_MAX)), round to nearest
    even, saturating; in 1 x 16 and 16 x 16 blocks.
  - FP8 blockwise (TE's Float8BlockScaling, its scale_from_amax_tensor):
    scale = 448 / amax (1 for amax 0, FLT_MAX where that overflows),
    optionally down to a power of two (frexp's exponent - 1), elements
    e4m3(x * scale), stored scale 1 / scale; 1 x 128 and 128 x 128 blocks.
  - MXFP8 in 32 x 32 blocks under NVIDIA's rule (amax / 448 raised to a
    power of two).
  - The 16-point Hadamard transform (H = S H16 / 4, TE's sign vector).

Run by the leg's interpreter (AMPX_PYTHON). Torch's float8_e4m3fn cast
rounds the E4M3 values (inputs clamped to +-448 first: torch before 2.13
does not saturate); E2M1 rounds by the value grid here. Without float8
dtypes or safetensors (the host leg), block_reference.json says why and the
tests skip.

block_formulas.json needs neither, and is written on every leg (torch 1.13
included): the Hadamard matrix H and a transform by it, and a layer under
Float8BlockScaling (y = x w^T, grad_x = g w, grad_w = g^T x) from E4M3
values rounded in float64 by their binade's quantum (e4m3_by_binade; where
torch has float8, checked against its cast), on inputs whose products are
exact in any order of summation.

The "ties" input has blocks where rounding NVFP4's block scale twice (amax
/ 6, then times S_enc) gives another scale than TE's one rounding.

Files in OUT_DIR: block_reference.json (torch version, inputs, cases) and
block_reference.safetensors: <input> (float32), and per case
<input>.<case>.codes (uint8, one code a byte, signs kept: -0 is 0x8 in
E2M1), .scales (uint8 E4M3 or E8M0 bytes, or float32 decoding scales),
.global_amax (float32 [1], NVFP4).
"""
import json
import os
import sys

import torch

SEED = 44
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
HADAMARD_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
FLT_MAX = torch.finfo(torch.float32).max


def unavailable():
    if not hasattr(torch, "float8_e4m3fn"):
        return "torch %s has no float8 dtypes" % torch.__version__
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return "no safetensors package for %s" % sys.executable
    return None


def f32(v):
    return torch.tensor(v, dtype=torch.float32)


def e4m3(v):
    """float32 -> (E4M3 byte, its value), nearest even, saturating; NaN stays NaN."""
    q = v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    q = torch.where(torch.isnan(v), torch.full_like(q, float("nan")), q)
    return q.view(torch.uint8), q.to(torch.float32)


def e2m1_codes(v):
    """float32 -> E2M1 codes: nearest value of the grid, ties to the even
    code, saturating at 6, the sign bit kept (a NaN gives a signed zero)."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
    a = v.abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a).clamp(max=6.0)
    dist = (a.unsqueeze(-1) - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    tie = dist == best
    even = torch.arange(8) % 2 == 0
    prefer = tie & even
    idx = torch.where(prefer.any(-1), prefer.int().argmax(-1), tie.int().argmax(-1))
    return (idx + 8 * torch.signbit(v).long()).to(torch.uint8)


def blocks(x, rows, cols):
    """The [R/rows, C/cols] block amaxes of a 2-D float32 tensor (NaN wins)."""
    R, C = x.shape
    t = x.abs().reshape(R // rows, rows, C // cols, cols)
    return t.amax(dim=(1, 3)), t


def expand(s, rows, cols):
    return s.repeat_interleave(rows, 0).repeat_interleave(cols, 1)


def nvfp4(x, rows):
    global_amax = x.abs().max()
    s_enc = torch.minimum(f32(448.0 * 6.0) / global_amax, f32(FLT_MAX))
    if global_amax == 0 or s_enc == 0:
        s_enc = f32(1.0)
    amax, _ = blocks(x, rows, 16)
    scale_bytes, scale = e4m3(amax * (s_enc * f32(1.0 / 6.0)))
    encode = torch.minimum(1.0 / (scale * (1.0 / s_enc)), f32(FLT_MAX))
    codes = e2m1_codes(x * expand(encode, rows, 16))
    return codes, scale_bytes, global_amax.reshape(1)


def fp8_blockwise_scale(x, rows, cols, pow2):
    """The encoding scale of each block, 448 / amax (1 for amax 0, FLT_MAX
    where that overflows), rounded down to a power of two when pow2."""
    amax, _ = blocks(x, rows, cols)
    scale = f32(448.0) / amax
    scale = torch.where(torch.isinf(scale), f32(FLT_MAX), scale)
    scale = torch.where(amax == 0, f32(1.0), scale)
    if pow2:
        _, e = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), (e - 1).to(torch.float32))
    return scale


def fp8_blockwise(x, rows, cols, pow2):
    scale = fp8_blockwise_scale(x, rows, cols, pow2)
    codes, _ = e4m3(x * expand(scale, rows, cols))
    return codes, 1.0 / scale


def mxfp8_rceil(x, rows, cols):
    amax, _ = blocks(x, rows, cols)
    descale = amax / f32(448.0)
    m, e = torch.frexp(descale)
    up = torch.where(m == 0.5, e - 1, e).clamp(-127, 127)
    byte = torch.where(descale == 0, torch.zeros_like(up), up + 127).to(torch.uint8)
    scale = torch.ldexp(torch.ones_like(descale), (byte.long() - 127).to(torch.float32))
    codes, _ = e4m3(x * expand(1.0 / scale, rows, cols))
    return codes, byte


def hadamard16(x):
    n = torch.arange(16)
    parity = torch.tensor([[bin(int(i) & int(j)).count("1") % 2 for j in n] for i in n])
    h16 = 1.0 - 2.0 * parity.to(torch.float32)
    h = torch.tensor(HADAMARD_SIGNS, dtype=torch.float32).unsqueeze(1) * h16 / 4.0
    return (x.reshape(-1, 16) @ h).reshape(x.shape)


def e4m3_by_binade(v):
    """float32 -> the nearest E4M3 value, ties to the even significand (the
    even code), saturating at +-448, sign kept; no float8 dtype needed: in
    float64, |v| over the quantum of its binade [2^(e-1), 2^e), 2^(e-4) (E4M3's
    3 mantissa bits; 2^-9 below 2^-6, the subnormals), rounded half to even."""
    a = v.to(torch.float64).abs()
    _, e = torch.frexp(a)
    quantum = torch.ldexp(torch.ones_like(a), (e - 4).clamp(min=-9).to(torch.float64))
    r = (torch.round(a / quantum) * quantum).clamp(max=448.0)
    r = torch.where(torch.signbit(v), -r, r).to(torch.float32)
    if hasattr(torch, "float8_e4m3fn"):
        assert torch.equal(r, e4m3(v)[1]), "e4m3_by_binade differs from torch's float8 cast"
    return r


def fp8_blockwise_values(x, rows, cols):
    """x in FP8 blockwise (TE's Float8BlockScaling: power-of-2 scales) and
    back: each element's E4M3 value times its block's decoding scale."""
    scale = fp8_blockwise_scale(x, rows, cols, pow2=True)
    return e4m3_by_binade(x * expand(scale, rows, cols)) * expand(1.0 / scale, rows, cols)


def fp8block_linear(g):
    """A layer [256 -> 256] without bias under Float8BlockScaling() (TE's
    defaults): y = x w^T from x in 1 x 128 blocks and w in 128 x 128;
    grad_x = g w from g in 1 x 128 blocks and the forward's w; grad_w = g^T x
    from both in 128 x 1 blocks (down the tokens). The weight's rows span 12
    binades, so that its 128 x 128 blocks round the small rows' elements
    coarser than 1 x 128 blocks (or 128 x 1) would. Each row of x (of g) has
    two nonzeros in one block of 128, the second up to 2^6 smaller: every
    output is a sum of at most two products of E4M3 values times powers of
    two, exact in float32 whatever the order of summation, once rounded."""
    w = torch.randn(256, 256, generator=g) * torch.exp2(
        -torch.randint(0, 12, (256, 1), generator=g).to(torch.float32))
    tokens = torch.arange(128)
    first = (tokens // 64) * 128 + 2 * (tokens % 64)  # rows' pairs: every column once

    def sparse(perm):
        t = torch.zeros(128, 256)
        t[tokens, first[perm]] = torch.randn(128, generator=g)
        t[tokens, first[perm] + 1] = torch.randn(128, generator=g) * torch.exp2(
            -torch.randint(0, 7, (128,), generator=g).to(torch.float32))
        return t

    x = sparse(torch.arange(128))
    gy = sparse(torch.randperm(128, generator=g))
    wq = fp8_blockwise_values(w, 128, 128)
    xq, gq = fp8_blockwise_values(x, 1, 128), fp8_blockwise_values(gy, 1, 128)
    x_cols, g_cols = fp8_blockwise_values(x, 128, 1), fp8_blockwise_values(gy, 128, 1)
    d = torch.float64  # products and sums of two exact, then one rounding
    return {"x": x, "weight": w, "grad_y": gy,
            "y": (xq.to(d) @ wq.to(d).t()).to(torch.float32),
            "grad_x": (gq.to(d) @ wq.to(d)).to(torch.float32),
            "grad_w": (g_cols.to(d).t() @ x_cols.to(d)).to(torch.float32)}


def formulas():
    """block_formulas.json: what needs no float8 dtype nor safetensors."""
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(8, 64, generator=g)
    out = {"torch": torch.__version__,
           "hadamard16": {"matrix": hadamard16(torch.eye(16)), "x": x, "values": hadamard16(x)},
           "fp8block_linear": fp8block_linear(g)}
    return {k: {n: t.tolist() for n, t in v.items()} if isinstance(v, dict) else v
            for k, v in out.items()}


def inputs():
    g = torch.Generator().manual_seed(SEED)
    randn = torch.randn(256, 256, generator=g)
    binades = torch.randint(-20, 20, (256, 1), generator=g).to(torch.float32)
    random = randn * torch.exp2(binades)
    edge = torch.randn(256, 256, generator=g)
    edge[0:16, 0:32] = 0.0                  # zero blocks
    edge[16, 0:16] = -0.0                   # -0 elements
    edge[32:48, 0:128] *= 2.0 ** -30        # blocks far below the tensor's amax
    edge[48, 0:16] = torch.tensor(E2M1_GRID + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0])
    edge[64, 0] = 1000.0                    # the tensor's amax, in one block
    edge[80:96, 128:256] *= 2.0 ** 20       # a second binade region
    edge[128, 0:128] = 448.0 * 2.0 ** torch.arange(-64, 64).to(torch.float32) / 2 ** 32
    gpt_like = (torch.randn(256, 256, generator=g) *
                torch.rand(1, 256, generator=g) * 4).to(torch.bfloat16).to(torch.float32)
    return {"random": random, "edge": edge, "bf16": gpt_like, "ties": nvfp4_ties(g)}


def nvfp4_ties(g):
    """Blocks whose amax puts NVFP4's block scale near an E4M3 tie, where
    rounding block_amax * (S_enc * (1/6)) once and (block_amax / 6) * S_enc
    twice give different scales: the global amax is 1000, and each block's
    amax is one found by trying the float32 neighbours of a tie."""
    s_enc = f32(448.0 * 6.0) / f32(1000.0)
    found = []
    for k in range(8):
        for binade in range(-2, 8):
            base = f32((1 + (2 * k + 1) / 16) * 2.0 ** binade * 6) / s_enc
            for step in range(-8, 9):
                amax = (base.view(torch.int32) + step).view(torch.float32)
                once = amax * (s_enc * f32(1.0 / 6.0))
                twice = (amax / f32(6.0)) * s_enc
                if e4m3(once)[0] != e4m3(twice)[0]:
                    found.append(amax)
    x = torch.rand(128, 256, generator=g) * 0.5
    blocks_per_row = 256 // 16
    for i, amax in enumerate(found[:16 * blocks_per_row]):
        x[i // blocks_per_row, (i % blocks_per_row) * 16 + 3] = -amax
    x[0, 0] = 1000.0
    return x


CASES = {
    "nvfp4_1x16": lambda x: dict(zip(("codes", "scales", "global_amax"), nvfp4(x, 1))),
    "nvfp4_16x16": lambda x: dict(zip(("codes", "scales", "global_amax"), nvfp4(x, 16))),
    "fp8block_1x128_pow2": lambda x: dict(zip(("codes", "scales"), fp8_blockwise(x, 1, 128, True))),
    "fp8block_1x128": lambda x: dict(zip(("codes", "scales"), fp8_blockwise(x, 1, 128, False))),
    "fp8block_128x128_pow2":
        lambda x: dict(zip(("codes", "scales"), fp8_blockwise(x, 128, 128, True))),
    "mxfp8_32x32_rceil": lambda x: dict(zip(("codes", "scales"), mxfp8_rceil(x, 32, 32))),
    "hadamard16": lambda x: {"values": hadamard16(x)},
}


def main():
    if len(sys.argv) != 3 or sys.argv[1] != "generate":
        sys.exit(__doc__)
    out_dir = sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "block_formulas.json"), "w") as f:
        json.dump(formulas(), f)
    manifest = os.path.join(out_dir, "block_reference.json")
    reason = unavailable()
    if reason:
        with open(manifest, "w") as f:
            json.dump({"torch": None, "reason": reason}, f)
        return
    import safetensors.torch

    tensors = {}
    for name, x in inputs().items():
        tensors[name] = x.contiguous()
        for case, fn in CASES.items():
            for part, t in fn(x).items():
                tensors[f"{name}.{case}.{part}"] = t.contiguous()
    safetensors.torch.save_file(tensors, os.path.join(out_dir, "block_reference.safetensors"))
    with open(manifest, "w") as f:
        json.dump({"torch": torch.__version__, "inputs": list(inputs()), "cases": list(CASES)},
                  f, indent=1)


if __name__ == "__main__":
    main()
