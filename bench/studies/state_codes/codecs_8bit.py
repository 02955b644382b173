"""8-bit block codes of AdamW's moments: bitsandbytes' dynamic tree map (through torchao's own
functions, whose codes ampx's equal bit for bit: tests/reference/optim_state_reference.py), the
map with ampx's floor for positive second moments, and linear codes.

Every code scales a block of 256 elements by s = max(absmax, 1e-12), stores the nearest of 256
map values of x / s (ties up: torchao's quantize_8bit_with_qmap) and decodes map[code] * s.

    dynamic   bitsandbytes' dynamic tree map, 7 exponent bits at most: signed [-0.993, 1] with
              zero at code 127, unsigned [0, 1] (torchao's AdamW8bit; ampx's before 6d2d7fa)
    linear    evenly spaced: signed (c - 127) / 128, [-0.992, 1] with zero at code 127 as the
              dynamic map; unsigned (c + 1) / 256, no zero (torchao's 4-bit unsigned map,
              linspace(0, 1, 17)[1:], at 8 bits)
    linear0   the linear signed map; unsigned c / 255, with zero
    dynamic-floor  the dynamic map, but a positive second moment whose nearest code is 0 takes
              code 1 (ampx's --optimizer-state 8bit since 6d2d7fa, as its FP8 state does with
              E4M3's smallest subnormal)
"""
import torch
from torchao.optim.quant_utils import create_dynamic_map, quantize_8bit_with_qmap

BLOCK = 256
CODES = ("dynamic", "dynamic-floor", "linear", "linear0")


def maps(code):
    """(signed map, unsigned map), each 256 ascending float32 values."""
    c = torch.arange(256, dtype=torch.float64)
    if code in ("dynamic", "dynamic-floor"):
        signed = torch.tensor(create_dynamic_map(signed=True), dtype=torch.float64)
        unsigned = torch.tensor(create_dynamic_map(signed=False), dtype=torch.float64)
    elif code in ("linear", "linear0"):
        signed = (c - 127) / 128
        unsigned = (c + 1) / 256 if code == "linear" else c / 255
    else:
        raise ValueError(f"code '{code}' is none of {CODES}")
    return signed.float(), unsigned.float()


def roundtrip(x, qmap, floor=False, block=BLOCK):
    """x through a block code of map `qmap`: the values its codes decode to. With `floor`, a
    positive x whose code is 0 takes code 1."""
    n = x.numel()
    flat = torch.cat([x.reshape(-1).float(), x.new_zeros((-n) % block, dtype=torch.float32)])
    b = flat.view(-1, block)
    s = b.abs().amax(1, keepdim=True).clamp_min(1e-12)
    codes = quantize_8bit_with_qmap(b / s, qmap)
    if floor:
        codes = torch.where((codes == 0) & (b > 0), torch.ones_like(codes), codes)
    return (qmap[codes.long()] * s).reshape(-1)[:n].view_as(x)
