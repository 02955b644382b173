#!/usr/bin/env python3
"""torchao's low-bit AdamW state as a file ampx loads
(tests/optim/optim_state_file_test.cpp), through tools/optim_state_torchao.py.

  optim_state_interop.py generate OUT_DIR

Run by the leg's own interpreter (AMPX_PYTHON); where torchao, float8 dtypes
or safetensors are missing (the Debian legs) it writes optim_interop.json
saying why and exits 0, and the C++ tests skip with that reason.

For torchao's AdamW8bit and AdamWFp8 (lr 1e-2, betas 0.9 / 0.999, eps 1e-8,
weight decay 0.01, block 256), over three float32 parameters: "w" [32, 256]
(quantized by torchao), "odd" [4100] (not a whole number of blocks: torchao
keeps float32 moments, ampx codes them), "b" [64] (both keep float32), three
steps of seeded gradients, then:

  optim_interop_KIND.safetensors            from_torch's file of the state
  optim_interop_KIND_reference.safetensors  N.param3, N.grad4, N.param4 (the
                                            parameters after step 3, the
                                            fourth gradient, after step 4),
                                            N.exp_avg3 and N.exp_avg_sq3
                                            (torchao's moments dequantized)

and checks the converter against torchao itself: the file's state given
back to a new torchao optimizer (to_torch) takes the fourth step to the
same parameters bit for bit, and moment() decodes the file's codes to
torchao's dequantized moments exactly. torchao's step runs eagerly
(TORCHDYNAMO_DISABLE: its torch.compile'd step would compile for minutes
here; the arithmetic is the same ops).
"""
import json
import os
import sys

os.environ["TORCHDYNAMO_DISABLE"] = "1"

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))

SHAPES = {"w": (32, 256), "odd": (4100,), "b": (64,)}
STEPS = 3
SEED = 650


def why_not():
    if not hasattr(torch, "float8_e4m3fn"):
        return "torch %s has no float8 dtypes" % torch.__version__
    try:
        import safetensors.torch  # noqa: F401
        import torchao.optim  # noqa: F401
    except ImportError as e:
        return "no torchao.optim or safetensors for %s (%s)" % (sys.executable, e)
    return None


def params():
    g = torch.Generator().manual_seed(SEED)
    return {n: torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for n, s in SHAPES.items()}


def grads(step):
    g = torch.Generator().manual_seed(SEED + 1 + step)
    return {n: torch.randn(s, generator=g) * (0.01 if n == "b" else 1.0)
            for n, s in SHAPES.items()}


def make(kind, ps):
    import torchao.optim
    cls = torchao.optim.AdamW8bit if kind == "8bit" else torchao.optim.AdamWFp8
    return cls(list(ps.values()), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
               block_size=256)


def step(opt, ps, grad):
    for n, p in ps.items():
        p.grad = grad[n].clone()
    opt.step()


def generate(out_dir):
    path = os.path.join(out_dir, "optim_interop.json")
    reason = why_not()
    if reason:
        with open(path, "w") as f:
            json.dump({"torchao": None, "reason": reason}, f)
        return
    import torchao
    from safetensors.torch import load_file, save_file
    from optim_state_torchao import from_torch, moment, to_torch

    for kind in ("8bit", "fp8"):
        ps = params()
        opt = make(kind, ps)
        for t in range(STEPS):
            step(opt, ps, grads(t))
        tensors, metadata = from_torch(opt, ps.items())
        state_path = os.path.join(out_dir, "optim_interop_%s.safetensors" % kind)
        save_file(tensors, state_path, metadata)
        reference = {}
        for n, p in ps.items():
            reference[n + ".param3"] = p.detach().clone()
            for m in ("exp_avg", "exp_avg_sq"):
                v = opt.state[p][m]
                dense = v.dequantize() if hasattr(v, "dequantize") else v
                reference[n + "." + m + "3"] = dense.float().clone()
                decoded = moment(tensors, metadata, n, m)
                assert torch.equal(decoded, dense.float()), (kind, n, m, "moment() decodes")
        grad4 = grads(STEPS)
        # The same state given back through the file: the same fourth step.
        again = {n: torch.nn.Parameter(p.detach().clone()) for n, p in ps.items()}
        opt_again = make(kind, again)
        to_torch(opt_again, again.items(), load_file(state_path), metadata)
        step(opt, ps, grad4)
        step(opt_again, again, grad4)
        for n, p in ps.items():
            assert torch.equal(p, again[n]), (kind, n, "to_torch(from_torch(...)) steps alike")
            reference[n + ".grad4"] = grad4[n]
            reference[n + ".param4"] = p.detach().clone()
        save_file(reference,
                  os.path.join(out_dir, "optim_interop_%s_reference.safetensors" % kind))
    with open(path, "w") as f:
        json.dump({"torch": torch.__version__, "torchao": torchao.__version__,
                   "cpu_capability": torch.backends.cpu.get_cpu_capability(), "steps": STEPS,
                   "lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                   "block": 256, "shapes": {n: list(s) for n, s in SHAPES.items()}}, f)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "generate":
        sys.exit("usage: optim_state_interop.py generate OUT_DIR")
    os.makedirs(sys.argv[2], exist_ok=True)
    generate(sys.argv[2])
