"""Python's side of ampx's safetensors interop (ctest interop.safetensors_*):

  safetensors_interop.py write PATH   # safetensors.torch writes the expected tensors
  safetensors_interop.py check PATH   # reads ampx's file: exit 0 if equal

The tensors are tests/interop_safetensors.cpp's, made the same way. Exit 77
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


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "check"):
        sys.exit("usage: safetensors_interop.py write|check PATH")
    path = sys.argv[2]
    want = expected()
    if sys.argv[1] == "write":
        save_file(want, path, metadata={"written_by": "python"})
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
    if names != set(want) or meta.get("written_by") != "ampx":
        bad.append(f"names {sorted(names)}, metadata {meta}")
    if bad:
        sys.exit("Python's safetensors read ampx's file differently:\n  " + "\n  ".join(bad))
    print(f"Python's safetensors read ampx's file: {len(want)} tensors, equal")


if __name__ == "__main__":
    main()
