#!/usr/bin/env python3
"""torchao's MX casts as the reference for ampx's block-scaled formats
(tests/fp8/block/fp8_block_test.cpp, ampx/fp8/block.h).

  mx_torchao_reference.py generate OUT_DIR

Run by the leg's own interpreter (AMPX_PYTHON): the wheel leg's virtual
environment has torch 2.15 and torchao 0.18. Where torchao's mx_formats,
float8 dtypes or safetensors are missing (the Debian legs), the script
writes mx_torchao.json saying why and nothing else, and exits 0: the C++
tests skip with that reason (tests/skips/*.txt list them there).

Every input goes through torchao.prototype.mx_formats.mx_tensor.to_mx with
block size 32, for each element format (float8_e4m3fn, float8_e5m2, fp6
e3m2, fp6 e2m3, fp4 e2m1) and each ScaleCalculationMode (FLOOR, CEIL, EVEN,
RCEIL), and back through to_dtype(float32).

Files, in OUT_DIR:
  mx_torchao.json         torch and torchao versions, inputs, formats, rules;
                          or {"torchao": null, "reason": ...}
  mx_torchao.safetensors  <input>                     the input (float32 or bfloat16)
                          <input>.<fmt>.<rule>.scales uint8 E8M0 bytes [rows, cols / 32]
                          <input>.<fmt>.<rule>.codes  uint8 codes, one a byte (e2m1:
                                                      torchao's packed bytes, two a byte)
                          <input>.<fmt>.<rule>.values float32, to_dtype's dequantization
  <input>: random (rows of randn over 60 binades), edge (crafted blocks: zeros,
  -0, subnormal amaxes, powers of two, amax mantissas past each format's
  largest, ties, maxima, inf, NaN), bf16 (a bfloat16 input).
"""
import json
import os
import struct
import sys

import torch

import torchao_available

SEED = 43
BLOCK = 32
FORMATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")
RULES = ("floor", "ceil", "even", "rceil")


def unavailable():
    """Why this interpreter cannot give the reference, or None."""
    return torchao_available.why_not("torchao.prototype.mx_formats.mx_tensor",
                                     ["float8_e4m3fn", "float4_e2m1fn_x2"], "float8 or float4")


def f32(bits):
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def edge_blocks():
    """Blocks of 32 float32 values, each a case named in its comment."""
    blocks = []

    def block(values):
        values = list(values)[:BLOCK]
        blocks.append(values + [0.0] * (BLOCK - len(values)))

    block([0.0] * BLOCK)                                   # all zeros: scale byte 0
    block([-0.0, 0.0, -0.0, 1.0])                          # -0 beside a 1
    block([f32(0x00000001), f32(0x00400000), -f32(0x007FFFFF)])  # subnormal amax
    for e in (-120, -3, 0, 1, 7, 100):                     # amax a power of two
        block([2.0 ** e, -(2.0 ** e) / 3, (2.0 ** e) / 7])
    for mantissa in (1.25, 1.5, 1.625, 1.75, 1.875, 1.96875, 1.9999999):  # amax mantissas
        block([mantissa * 4.0, -1.0, 0.5, 0.25, 3.0, -2.75])
    # ties of every format's grid at scale 1 (amax 4, mantissa 1: every rule
    # but RCEIL gives e2m1 a scale of 1, e4m3 2^-6, ...), and values past max
    block([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, -0.25, -0.75, -2.5, -3.5, 3.9, 0.1])
    block([448.0, 464.0, 465.0, -480.0, 57344.0, 61440.0, 28.0, 30.0, 7.5, 7.75, 6.0, 5.0])
    block([1e30, -3e38, 1.0])                              # large amax
    block([float("inf"), 1.0, -2.0])                       # inf
    block([float("-inf"), 1.0, -2.0])
    block([float("nan"), 1.0, -2.0])                       # NaN
    gen = torch.Generator().manual_seed(SEED + 1)
    for _ in range(4):                                     # dense random blocks
        block((torch.randn(BLOCK, generator=gen) * 3).tolist())
    return torch.tensor(blocks, dtype=torch.float32)


def inputs():
    gen = torch.Generator().manual_seed(SEED)
    rows = torch.randn(30, 8 * BLOCK, generator=gen)
    binades = torch.arange(30, dtype=torch.float32).mul(2).sub(30).exp2().unsqueeze(1)
    return {
        "random": rows * binades,                          # 2^-30 .. 2^28
        "edge": edge_blocks(),
        "bf16": (torch.randn(6, 4 * BLOCK, generator=gen) * 20).to(torch.bfloat16),
    }


def main():
    if len(sys.argv) != 3 or sys.argv[1] != "generate":
        sys.exit(__doc__)
    out_dir = sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    manifest = os.path.join(out_dir, "mx_torchao.json")
    reason = unavailable()
    if reason:
        with open(manifest, "w") as f:
            json.dump({"torchao": None, "reason": reason}, f)
        return

    import safetensors.torch
    import torchao
    from torchao.prototype.mx_formats import config, constants, mx_tensor

    dtypes = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
              "e3m2": constants.DTYPE_FP6_E3M2, "e2m3": constants.DTYPE_FP6_E2M3,
              "e2m1": torch.float4_e2m1fn_x2}
    modes = {r: getattr(config.ScaleCalculationMode, r.upper()) for r in RULES}

    tensors = {}
    for name, x in inputs().items():
        tensors[name] = x.contiguous()
        for fmt in FORMATS:
            for rule in RULES:
                scales, data = mx_tensor.to_mx(x, dtypes[fmt], BLOCK, modes[rule])
                values = mx_tensor.to_dtype(data, scales, dtypes[fmt], BLOCK, torch.float32)
                key = f"{name}.{fmt}.{rule}"
                tensors[key + ".scales"] = scales.view(torch.uint8).contiguous()
                tensors[key + ".codes"] = data.view(torch.uint8).contiguous()
                tensors[key + ".values"] = values.contiguous()
    safetensors.torch.save_file(tensors, os.path.join(out_dir, "mx_torchao.safetensors"))
    with open(manifest, "w") as f:
        json.dump({"torchao": torchao.__version__, "torch": torch.__version__, "block": BLOCK,
                   "inputs": list(inputs()), "formats": list(FORMATS), "rules": list(RULES)},
                  f, indent=1)


if __name__ == "__main__":
    main()
