#!/usr/bin/env python3
"""Python's side of ampx-train --export-weights (ExportWeightsTest, tests/train):

    export_weights_logits.py WEIGHTS LOGITS

WEIGHTS is the safetensors file ampx-train wrote; its metadata names the
workload and the model's shape. bench/python/ampx_models.py builds the same
model, safetensors.torch.load_model loads the file into it (strict: the same
names and shapes, nothing missing, nothing left over), and it runs the batch
LOGITS holds ("input", written by ampx's test) in fp32, eval mode, one
thread. LOGITS also holds ampx's own logits for that batch from its C++ model
(apps/workloads/models.h) with the trained weights restored from the run's
checkpoint, not from WEIGHTS (an export that transposes or misnames a tensor
changes Python's logits only). Python's model is built twice, with nn.Linear
(what a user writes) and with ampx_models' LibTorchLinear (the C++ models'
one addmm on a 2-D view):

  logits_explicit  gpt with --attention explicit: matmul, masked_fill,
                   softmax, matmul, the ops of the Python model. These must
                   equal Python's bit for bit (compared as int32 bits), with
                   either Linear.
  logits_fused     gpt's default CPU attention, ampx::scaled_dot_product_attention:
                   one fused kernel with a blocked online softmax (running
                   row maximum and sum, earlier output rescaled, O / l at the
                   end), so its float32 sums and exponentials run in another
                   order than matmul + softmax + matmul. The largest
                   difference from Python's is printed, not claimed equal.

Exit status 0 when the explicit logits are bitwise equal, 1 otherwise, 77
(ctest's skip) where Python has no safetensors package (Debian:
python3-safetensors; the forky leg installs it).
"""
import os
import sys

import torch

try:
    from safetensors import safe_open
    from safetensors.torch import load_file, load_model
except ImportError:
    print("no safetensors package (Debian: python3-safetensors)")
    sys.exit(77)

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench", "python"))
from ampx_models import build_model  # noqa: E402


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    weights, logits = sys.argv[1], sys.argv[2]
    with safe_open(weights, framework="pt") as f:
        meta = f.metadata() or {}
    workload = meta.get("workload")
    shape = {k: int(meta[k]) for k in ("vocab", "block_size", "layers", "heads", "d_model")}
    torch.set_num_threads(1)
    ref = load_file(logits)

    def bitwise(a, b):
        return a.dtype == b.dtype == torch.float32 and a.shape == b.shape and torch.equal(
            a.view(torch.int32), b.view(torch.int32))

    def max_diff(a, b):
        return (a.double() - b.double()).abs().max().item()

    ok = True
    # nn.Linear (aten::linear), what a Python user writes, and LibTorchLinear (one addmm on
    # a 2-D view, as the C++ models apply their Linears): on 2.14 both give the C++ bits.
    for linear in ("torch", "libtorch"):
        model = build_model(workload, linear=linear, **shape)
        load_model(model, weights)  # strict=True
        model.eval()
        with torch.no_grad():
            out = model(ref["input"])
        if linear == "torch":
            print(f"{os.path.basename(weights)}: {workload} {shape}, precision "
                  f"{meta.get('precision')}, torch {torch.__version__}, batch "
                  f"{tuple(ref['input'].shape)} -> logits {tuple(out.shape)}")
        same = bitwise(out, ref["logits_explicit"])
        ok = ok and same
        print(f"  {'ok  ' if same else 'FAIL'} linear={linear}: Python's fp32 logits vs ampx's "
              "(explicit attention): " + ("bitwise equal" if same else
                                          f"differ, max |diff| {max_diff(out, ref['logits_explicit']):.3e}"))
        fused = ref["logits_fused"]
        print(f"  info linear={linear}: Python's vs ampx's with its fused attention: "
              + ("bitwise equal" if bitwise(out, fused) else f"max |diff| {max_diff(out, fused):.3e}")
              + f" (logits up to {fused.abs().max().item():.3f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
