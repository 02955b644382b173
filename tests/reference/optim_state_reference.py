#!/usr/bin/env python3
"""torchao's low-bit optimizer state as the reference for ampx's
(tests/optim/optim_state_test.cpp).

  optim_state_reference.py generate OUT_DIR

Run by the leg's own interpreter (AMPX_PYTHON): the wheel leg's virtual
environment has torchao (scripts/wheel-env.sh). Where torchao or float8
dtypes are missing (the Debian legs), the script writes
optim_state_torchao.json saying why and exits 0: the C++ tests skip with
that reason (tests/skips/*.txt list them).

optim_state_torchao.json, float32 values as their bits (unsigned ints):
  versions, cpu_capability     torch's, torchao's; the ATen ISA it ran on
  qmap_signed, qmap_unsigned   torchao.optim.quant_utils.create_dynamic_map
                               (signed and unsigned, 7 exponent bits, 8
                               bits): the 8-bit state's code maps. torchao
                               builds them with torch.linspace in float32,
                               whose roundings depend on the ISA (DEFAULT
                               and AVX2 / AVX-512 give maps an ulp apart)
  x                            inputs in [-1, 1] (a value over its block's
                               absmax): seeded uniform, the map values
                               themselves, the midpoints between neighbours
                               (ties) and their float neighbours, 0, +-1
  codes_signed, codes_unsigned quantize_8bit_with_qmap(x, map) (unsigned: of
                               |x|), with torchao's maps above
  fp8_block                    256
  fp8_input                    [blocks * 256]: seeded normal blocks at
                               scales 1e-30 .. 1e4, one with a single large
                               value, one of zeros, one of subnormal floats
  fp8_codes, fp8_scales        torchao.optim.subclass_fp8.quantize_fp8
                               (codes as E4M3 bytes)
"""
import json
import os
import struct
import sys

import torch

SEED = 65


def bits(values):
    return [struct.unpack("<I", struct.pack("<f", float(v)))[0] for v in values]


def why_not():
    if not hasattr(torch, "float8_e4m3fn"):
        return "torch %s has no float8 dtypes" % torch.__version__
    try:
        import torchao.optim.quant_utils  # noqa: F401
        import torchao.optim.subclass_fp8  # noqa: F401
    except ImportError as e:
        return "no torchao.optim for %s (%s)" % (sys.executable, e)
    return None


def inputs(qmap):
    g = torch.Generator().manual_seed(SEED)
    x = [torch.rand(4000, generator=g) * 2 - 1]
    q = torch.tensor(qmap, dtype=torch.float32)
    mid = (q[:-1] + q[1:]) / 2
    x += [q, mid, torch.nextafter(mid, torch.full_like(mid, 2.0)),
          torch.nextafter(mid, torch.full_like(mid, -2.0)),
          torch.tensor([0.0, 1.0, -1.0, 1e-30, -1e-30])]
    return torch.cat(x).clamp(-1, 1)


def fp8_inputs():
    g = torch.Generator().manual_seed(SEED + 1)
    blocks = [torch.randn(256, generator=g) * s for s in (1e-30, 1e-8, 1e-3, 1.0, 1e4)]
    one_large = torch.randn(256, generator=g) * 1e-3
    one_large[17] = 50.0
    subnormal = torch.randn(256, generator=g) * 1e-40
    return torch.cat(blocks + [one_large, torch.zeros(256), subnormal])


def generate(out_dir):
    path = os.path.join(out_dir, "optim_state_torchao.json")
    reason = why_not()
    if reason:
        with open(path, "w") as f:
            json.dump({"torchao": None, "reason": reason}, f)
        return
    import torchao
    from torchao.optim.quant_utils import create_dynamic_map, quantize_8bit_with_qmap
    from torchao.optim.subclass_fp8 import quantize_fp8

    signed, unsigned = create_dynamic_map(True), create_dynamic_map(False)
    x = inputs(signed)
    codes_s = quantize_8bit_with_qmap(x, torch.tensor(signed, dtype=torch.float32))
    codes_u = quantize_8bit_with_qmap(x.abs(), torch.tensor(unsigned, dtype=torch.float32))
    fx = fp8_inputs()
    fcodes, fscales = quantize_fp8(fx, 256)
    out = {
        "torch": torch.__version__,
        "torchao": torchao.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "qmap_signed": bits(signed),
        "qmap_unsigned": bits(unsigned),
        "x": bits(x.tolist()),
        "codes_signed": codes_s.tolist(),
        "codes_unsigned": codes_u.tolist(),
        "fp8_block": 256,
        "fp8_input": bits(fx.tolist()),
        "fp8_codes": fcodes.view(torch.uint8).tolist(),
        "fp8_scales": bits(fscales.tolist()),
    }
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "generate":
        sys.exit("usage: optim_state_reference.py generate OUT_DIR")
    os.makedirs(sys.argv[2], exist_ok=True)
    generate(sys.argv[2])
