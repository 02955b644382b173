"""Python's side of ampx's safetensors interop (ctest interop.safetensors_*):

  safetensors_interop.py write PATH   # safetensors.torch writes the expected tensors
  safetensors_interop.py check PATH   # reads ampx's file: exit 0 if equal

The tensors are tests/helpers/interop_safetensors.cpp's, made the same way. FP8
(torch.float8_e4m3fn / float8_e5m2, safetensors' F8_E4M3 / F8_E5M2): each
FP8 tensor "<name>" has its scale_inv beside it as "<name>_scale" (F32), and
its values are the one-liner codes.float() * scale; ampx's file also holds
"<name>_values", what ampx's dequantize() gives, which they must equal bit
for bit. Exit 77
(ctest's skip) where the safetensors package is missing (Debian:
python3-safetensors; the forky leg installs it).
"""
import sys

import torch

try:
    from safetensors import safe_open
    from safetensors.torch import save_file
except ImportError:
    print("no safetensors package (Debian: python3-safetensors)")
    sys.exit(77)


def expected():
    def floats(n, dtype, shape):
        return (torch.arange(n, dtype=torch.float64) * 0.37 - 1.5).to(dtype).reshape(shape)

    def ints(n, dtype, shape):
        return (torch.arange(n, dtype=torch.int64) - 3).to(dtype).reshape(shape)

    return {
        "blocks.0.fc.weight": floats(12, torch.float32, (3, 4)),
        "f64": floats(6, torch.float64, (6,)),
        "f16": floats(10, torch.float16, (2, 5)),
        "bf16": floats(8, torch.bfloat16, (2, 2, 2)),
        "i64": ints(5, torch.int64, (5,)),
        "i32": ints(4, torch.int32, (2, 2)),
        "i16": ints(3, torch.int16, (3,)),
        "i8": ints(7, torch.int8, (7,)),
        "u8": (torch.arange(9, dtype=torch.int64) * 29).to(torch.uint8),
        "bool": torch.arange(7, dtype=torch.int64).remainder(3).eq(0),
        "scalar": floats(1, torch.float32, ()),
    }


def expected_fp8():
    """name -> (codes as torch casts them, scale_inv): x * scale clamped to the
    format's max (ampx saturates), rounded to nearest even by torch's cast."""
    x = (torch.arange(24, dtype=torch.float64) * 0.37 - 4.5).to(torch.float32).reshape(4, 6)
    out = {}
    for name, dtype, scale in (("e4m3", torch.float8_e4m3fn, 100.0 / 3.0),
                               ("e5m2", torch.float8_e5m2, 0.7)):
        s = torch.full((1,), scale, dtype=torch.float32)
        top = torch.finfo(dtype).max
        out[name] = ((x * s).clamp(-top, top).to(dtype), torch.ones(1) / s)
    return out


def check_fp8(f, names, bad):
    for name, (codes, scale_inv) in expected_fp8().items():
        if not {name, name + "_scale", name + "_values"} <= names:
            bad.append(f"{name}: missing, or its _scale or _values")
            continue
        got = f.get_tensor(name)
        if got.dtype != codes.dtype or not torch.equal(got.view(torch.uint8), codes.view(torch.uint8)):
            bad.append(f"{name}: {got.dtype} codes differ from torch's cast")
        scale = f.get_tensor(name + "_scale")
        if scale.dtype != torch.float32 or not torch.equal(scale, scale_inv):
            bad.append(f"{name}_scale: {scale} is not scale_inv {scale_inv}")
        values = got.float() * scale  # the documented one-liner
        ampx_values = f.get_tensor(name + "_values")
        if not torch.equal(values.view(torch.int32), ampx_values.view(torch.int32)):
            diff = (values - ampx_values).abs().max().item()
            bad.append(f"{name}: codes.float() * scale differs from ampx's dequantize() by {diff}")


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "check"):
        sys.exit("usage: safetensors_interop.py write|check PATH")
    path = sys.argv[2]
    want = expected()
    fp8 = expected_fp8()
    if sys.argv[1] == "write":
        tensors = dict(want)
        for name, (codes, scale_inv) in fp8.items():
            tensors[name] = codes
            tensors[name + "_scale"] = scale_inv
        save_file(tensors, path, metadata={"written_by": "python"})
        return
    bad = []
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        names = set(f.keys())
        for name, t in want.items():
            if name not in names:
                bad.append(f"{name}: missing")
                continue
            got = f.get_tensor(name)
            if got.dtype != t.dtype or got.shape != t.shape or not torch.equal(got, t):
                bad.append(f"{name}: {got.dtype} {tuple(got.shape)} differs")
        check_fp8(f, names, bad)
    fp8_names = {n + suffix for n in fp8 for suffix in ("", "_scale", "_values")}
    if names != set(want) | fp8_names or meta.get("written_by") != "ampx":
        bad.append(f"names {sorted(names)}, metadata {meta}")
    if bad:
        sys.exit("Python's safetensors read ampx's file differently:\n  " + "\n  ".join(bad))
    print(f"Python's safetensors read ampx's file: {len(want)} tensors and {len(fp8)} FP8 ones, "
          "their values equal to ampx's bit for bit")


if __name__ == "__main__":
    main()
