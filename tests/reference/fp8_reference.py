#!/usr/bin/env python3
"""FP8 reference values for ampx's tests (tests/fp8/fp8_cast_test.cpp, fp8_scaling_test.cpp).

  fp8_reference.py generate OUT_DIR

Cast references come from PyTorch's own float8 casts and need torch 2.1+ (the
LibTorch 2.6 leg's Python); with an older torch the script says so and writes
none of them (the C++ conformance tests then skip). Files, little-endian:
  fp8_cast_f32_inputs.bin       float32 inputs: random bit patterns, random
                                values across both formats' ranges, and every
                                rounding boundary (code values, midpoints
                                between neighbours, +-max, half the smallest
                                subnormal, ...) each with its neighbours +-1 ulp
  fp8_cast_f32_<fmt>.bin        uint8 codes: x.clamp(-max, max).to(float8_<fmt>)
                                (NaN cast as it is: see clamp_cast)
  fp8_cast_bf16_<fmt>.bin       uint8 codes of the 65536 bfloat16 bit patterns
                                (index = pattern), the same clamp-then-cast
  fp8_cast.json                 torch version, sizes, maxima
  <fmt>: e4m3 (torch.float8_e4m3fn) or e5m2 (torch.float8_e5m2)

Scaling references need no float8 and are written on every torch:
  fp8_scaling.json  scale / scale_inv / amax history after every step of
                    scripted amax sequences, from TE's delayed scaling rule and
                    its compute_scale_from_amax (current scaling) restated
                    below in plain Python with float32 rounding
"""
import json
import math
import os
import random
import struct
import sys

import numpy as np
import torch

FLT_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def f32(x):
    """Round a Python float (double) to float32 (nearest even), inf beyond."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def div32(a, b):
    """float32 a / b, correctly rounded (double's quotient of two floats rounds
    once more to the same float32 result)."""
    if b == 0:
        return math.inf if a > 0 else math.nan
    return f32(a / b)


# ------------------------------------------------------------------- casts
def cast_inputs():
    g = torch.Generator().manual_seed(8)
    parts = [
        # every exponent, sign, NaN and inf: random bit patterns
        torch.randint(-2**31, 2**31, (400000,), generator=g, dtype=torch.int64)
        .to(torch.int32).view(torch.float32),
    ]
    # values spread over both formats' ranges, subnormals included
    for lo, hi in ((-20, -14), (-14, -6), (-6, 9), (9, 17)):
        e = torch.randint(lo, hi, (100000,), generator=g).to(torch.float32)
        m = torch.rand(100000, generator=g) + 1
        s = torch.randint(0, 2, (100000,), generator=g).to(torch.float32) * 2 - 1
        parts.append(s * m * torch.pow(2.0, e))
    # the boundaries: every finite code value of both formats and the
    # midpoints between neighbours, plus +-1 ulp of each, +-inf, zeros
    edges = []
    for fmt, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)
        vals = sorted(set(v for v in vals.tolist() if math.isfinite(v) and v >= 0))
        edges += vals
        edges += [(a + b) / 2 for a, b in zip(vals, vals[1:])]
        top = MAX[fmt]
        step = vals[-1] - vals[-2]
        edges += [top + step / 2, top + step, 2 * top, vals[1] / 2, vals[1] / 4]
    edges += [math.inf, FLT_MAX, 2.0**-126, 2.0**-149]
    b = torch.tensor(edges, dtype=torch.float32)
    ib = b.view(torch.int32)
    nb = torch.cat([ib - 1, ib, ib + 1])
    nb = nb[nb >= 0]  # 0 - 1 would wrap into negative NaN space
    pos = nb.view(torch.float32)
    parts.append(torch.cat([pos, -pos]))
    parts.append(torch.tensor([math.nan, -math.nan], dtype=torch.float32))
    return torch.cat(parts).contiguous()


def clamp_cast(x, fmt, dtype):
    """Saturate, then PyTorch's cast. NaN goes to the cast unclamped: PyTorch's
    vectorized bfloat16 clamp turns positive NaNs into 0xFFFF (negative), and
    the NaN's sign, which the cast keeps, is the cast's to decide."""
    clamped = torch.where(x.isnan(), x, x.clamp(-MAX[fmt], MAX[fmt]))
    return clamped.to(dtype).view(torch.uint8)


def write_casts(out):
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "float8_e5m2"):
        print("torch", torch.__version__, "has no float8 dtypes: no fp8 cast references written"
              " (the cast conformance tests skip)")
        return
    x = cast_inputs()
    with open(os.path.join(out, "fp8_cast_f32_inputs.bin"), "wb") as f:
        f.write(x.numpy().tobytes())
    bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for fmt, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        with open(os.path.join(out, "fp8_cast_f32_%s.bin" % fmt), "wb") as f:
            f.write(clamp_cast(x, fmt, dtype).numpy().tobytes())
        with open(os.path.join(out, "fp8_cast_bf16_%s.bin" % fmt), "wb") as f:
            f.write(clamp_cast(bf16, fmt, dtype).numpy().tobytes())
    with open(os.path.join(out, "fp8_cast.json"), "w") as f:
        json.dump(dict(torch_version=torch.__version__, f32_count=x.numel(), bf16_count=65536,
                       max=MAX), f, indent=1)
    print("fp8 cast references from torch", torch.__version__, ":", x.numel(), "float32 values")


# ------------------------------------------------------------------- scaling
def delayed_scaling(amaxes, fmt, history_len, algo, margin):
    """TE's delayed scaling (transformer_engine/common/recipe/delayed_scaling.cu,
    amax_and_scale_update_after_reduction) written out: the step's amax goes
    into slot 0, and unless it is 0 the history rolls by -1 (slot 0's amax to
    the end, slot 0 zeroed); amax = max of the window (fmaxf from 0: NaN
    ignored) or the most recent; scale = (fp8_max * 2^-margin) / amax when that
    is finite and > 0, else unchanged; inf -> FLT_MAX; scale_inv = 1 / scale."""
    scaled_max = f32(MAX[fmt] * f32(2.0 ** -margin))
    hist = [0.0] * history_len
    scale = 1.0
    steps = []
    for last in amaxes:
        hist[0] = last
        amax = 0.0
        if last != 0.0:
            window = hist[1:] + [last]
            for a in window:
                amax = amax if math.isnan(a) else max(amax, a)
            hist = [0.0] + hist[2:] + [last] if history_len > 1 else [0.0]
        if algo == "most_recent":
            amax = last
        if math.isfinite(amax) and amax > 0:
            scale = div32(scaled_max, amax)
        if math.isinf(scale):
            scale = FLT_MAX
        hist[0] = 0.0
        steps.append(dict(scale=bits(scale), scale_inv=bits(div32(1.0, scale)),
                          history=[bits(h) for h in hist]))
    return steps


def current_scale(amax, fmt, eps, pow2):
    """TE's compute_scale_from_amax (transformer_engine/common/recipe/recipe_common.cuh)."""
    if amax < eps:
        amax = eps
    if math.isinf(amax) or amax == 0 or math.isnan(amax):
        return 1.0
    scale = div32(MAX[fmt], amax)
    if math.isinf(scale):
        scale = FLT_MAX
    if pow2:
        scale = struct.unpack("<f", struct.pack("<I", bits(scale) & 0xFF800000))[0]
    return scale


def scaling_reference():
    rng = random.Random(14)
    special = [0.0, math.inf, math.nan, 1e-42, 3e38, 448.0, 57344.0, 1.0]
    seqs = []
    for _ in range(6):
        seq = []
        for i in range(60):
            r = rng.random()
            if r < 0.1:
                seq.append(rng.choice(special))
            else:
                seq.append(f32(math.exp(rng.uniform(-30, 30))))
        seqs.append(seq)
    cases = []
    for history_len in (1, 2, 5, 16):
        for algo in ("max", "most_recent"):
            for margin in (0, 2):
                for fmt in ("e4m3", "e5m2"):
                    for k, seq in enumerate(seqs):
                        cases.append(dict(
                            history_len=history_len, algo=algo, margin=margin, format=fmt,
                            amax=[bits(a) for a in seq],
                            steps=delayed_scaling(seq, fmt, history_len, algo, margin)))
    current = []
    amaxes = [f32(math.exp(rng.uniform(-90, 90))) for _ in range(200)] + special + [1e-45]
    for fmt in ("e4m3", "e5m2"):
        for eps in (0.0, 1e-4):
            for pow2 in (False, True):
                current.append(dict(format=fmt, amax_epsilon=bits(f32(eps)), power_2_scale=pow2,
                                    amax=[bits(a) for a in amaxes],
                                    scale=[bits(current_scale(a, fmt, f32(eps), pow2))
                                           for a in amaxes]))
    return dict(delayed=cases, current=current)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "generate":
        out = sys.argv[2]
        os.makedirs(out, exist_ok=True)
        write_casts(out)
        with open(os.path.join(out, "fp8_scaling.json"), "w") as f:
            json.dump(scaling_reference(), f)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
