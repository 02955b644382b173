#!/usr/bin/env python3
"""Checks that bench/python/ampx_models.py is the model ampx-train trains.

    parity_check.py EXPORT.pt      (written by ampx_parity_export; ctest runs both)

EXPORT.pt holds, for one workload, the initial weights of the LibTorch model
built as ampx-train builds it (torch::manual_seed, then models.h), a batch,
and what ampx computed on it: the fp32 output, loss and gradients, and the
output and loss of an O1 step (ampx's autocast, bf16). The Python model
computes the same things through torch_amp_bench.forward_loss, the code the
benchmark times, and they are compared:

  init    torch.manual_seed(seed) and the Python constructor give bit-identical
          weights (the benchmark starts where ampx-train starts)
  state   the exported state dict loads with strict=True (same names, shapes, dtypes)

then for each of ampx_models' two Linear flavours, the loss, output and grads
in fp32 and in bf16 (tensors: max |python - ampx| over max(1, max |ampx|)):

  linear="libtorch"  the ops ampx-train's C++ models run (addmm on 2-D views). Both sides
          then run the same kernels (Debian builds python3-torch and
          libtorch-dev from one source) on the same thread count, and every
          number is bit-identical on both legs (1.13 and 2.6); the bounds, 1e-6
          relative on losses and 1e-5 of scale on tensors, leave room for
          rounding noise only. This is the check that catches a wrong model:
          tanh GELU, a changed attention scale or LayerNorm eps each move the
          outputs by 7e-5 to 6e-3 of scale. (At initialisation the loss sits
          near ln(vocab) and moves far less, 5e-7 to 1e-5 relative, which is
          why outputs and grads are compared too.)
  linear="torch"     nn.Linear, what the benchmark runs by default. fp32: loss
          1e-5 relative, tensors 1e-4 of scale (seen: equal loss, 5e-7).
          bf16: where aten::linear and the C++ models' addmm round differently
          (one bf16 rounding, 2^-9 relative, on a Linear output), the bounds
          1e-4, 3e-2 and 1e-3 are 4 to 8x what that gives. (Before models.h
          applied its Linears to 2-D views, LibTorch's C++ Linear rounded the
          3-D product to bf16 before adding the bias: 1.9e-5 relative on the
          loss, 5.9e-3 of scale on the output, 1.2e-4 on the grads.)

Exit status 0 when every check passes.
"""
import os
import sys

try:
    import torch
except ImportError as e:
    sys.exit(f"parity_check: FAIL: this Python ({sys.executable}) cannot import torch ({e}); "
             f"install Debian's python3-torch or configure with -DAMPX_PYTHON=/path/to/python3")

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ampx_models import build_model  # noqa: E402
from torch_amp_bench import forward_loss  # noqa: E402

# (fp32 loss rel, fp32 tensors, bf16 loss rel, bf16 output, bf16 grads) per
# Linear flavour; tensors: max |python - ampx| / max(1, max |ampx|).
BOUNDS = {
    "libtorch": (1e-6, 1e-5, 1e-6, 1e-5, 1e-5),
    "torch": (1e-5, 1e-4, 1e-4, 3e-2, 1e-3),
}
# gpt-nn is built from stock modules on both sides (nn.MultiheadAttention,
# nn.Linear on 3-D inputs), whose Python and C++ versions run different ATen
# ops for the same math (LibTorch's C++ Linear adds the bias after a 3-D
# matmul; the two MultiheadAttention forwards differ in their projections):
# there is no bit-for-bit flavour, only the "torch" bounds.
BOUNDS_OF = {"gpt-nn": {"torch": BOUNDS["torch"]}}


def load(path):
    """The exporter's dict (LibTorch's pickle needs weights_only=False on torch >= 2.6)."""
    try:
        return torch.load(path, weights_only=False)
    except TypeError:  # a torch without weights_only
        return torch.load(path)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def scaled_max_diff(a, b):
    a, b = a.double(), b.double().reshape(a.shape)
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


class Checks:
    def __init__(self):
        self.failures = []

    def __call__(self, name, ok, detail):
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
        if not ok:
            self.failures.append(name)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    path = sys.argv[1]
    d = load(path)
    workload = os.path.splitext(os.path.basename(path))[0]
    meta = {k[len("meta/"):]: v.item() for k, v in d.items() if k.startswith("meta/")}
    state = {k[len("state/"):]: v for k, v in d.items() if k.startswith("state/")}
    inputs, target = d["input"], d["target"]
    torch.set_num_threads(meta["threads"])
    shape = {k: meta[k] for k in ("vocab", "block_size", "layers", "heads", "d_model") if k in meta}
    print(f"{workload}: torch {torch.__version__}, {meta['threads']} thread(s), batch {meta['batch']}"
          + (f", {shape}" if shape else ""))
    check = Checks()

    def fresh(linear):
        torch.manual_seed(meta["seed"])
        model = build_model(workload, linear=linear, **shape)
        model.train()
        return model

    # Names, shapes and dtypes, then the initial values from the seed.
    ours = fresh("torch").state_dict()
    missing, extra = sorted(set(state) - set(ours)), sorted(set(ours) - set(state))
    check("state names", not missing and not extra,
          f"{len(state)} tensors" if not missing and not extra
          else f"only in ampx: {missing}, only in Python: {extra}")
    if missing or extra:
        return report(workload, check.failures)
    differ = [k for k in state if ours[k].shape != state[k].shape or ours[k].dtype != state[k].dtype]
    check("state shapes and dtypes", not differ, "all equal" if not differ else f"differ: {differ}")
    if differ:
        return report(workload, check.failures)
    unequal = [k for k in state if not torch.equal(ours[k], state[k])]
    check("init from the seed", not unequal,
          "bit-identical to ampx-train's" if not unequal else f"differ: {unequal}")

    def check_grads(model, prefix, bound):
        diffs = {n: scaled_max_diff(p.grad, d[prefix + n]) for n, p in model.named_parameters()}
        worst = max(diffs, key=diffs.get)
        check(prefix.split("/")[0] + " grads", diffs[worst] <= bound,
              f"{len(diffs)} tensors, " + (f"worst {worst}: max diff {diffs[worst]:.2e} of scale"
                                           if diffs[worst] > 0 else "all bit-identical")
              + f" (bound {bound:g})")

    bounds = BOUNDS_OF.get(workload, BOUNDS)
    for linear, (loss32_tol, tensor32_tol, loss16_tol, out16_tol, grad16_tol) in bounds.items():
        print(f" linear={linear}")
        # fp32: output, loss and grads from the exported weights.
        model = fresh(linear)
        model.load_state_dict(state, strict=True)
        loss, out = forward_loss(model, inputs, target, "fp32")
        loss.backward()
        ref = d["fp32/loss"].item()
        check("fp32 loss", rel(loss.item(), ref) <= loss32_tol,
              f"python {loss.item():.8f}, ampx {ref:.8f}, rel diff {rel(loss.item(), ref):.2e} "
              f"(bound {loss32_tol:g})")
        diff = scaled_max_diff(out.detach(), d["fp32/output"])
        check("fp32 output", diff <= tensor32_tol, f"max diff {diff:.2e} of scale (bound {tensor32_tol:g})")
        check_grads(model, "fp32/grad/", tensor32_tol)

        # bf16: torch.autocast("cpu", bfloat16) as the benchmark runs it, fresh weights.
        model = fresh(linear)
        model.load_state_dict(state, strict=True)
        loss, out = forward_loss(model, inputs, target, "autocast-bf16")
        ref = d["bf16/loss"].item()
        check("bf16 loss", rel(loss.item(), ref) <= loss16_tol,
              f"python {loss.item():.8f}, ampx {ref:.8f}, rel diff {rel(loss.item(), ref):.2e} "
              f"(bound {loss16_tol:g}; fp32 loss {d['fp32/loss'].item():.8f})")
        diff = scaled_max_diff(out.detach(), d["bf16/output"])
        check("bf16 output", diff <= out16_tol, f"max diff {diff:.2e} of scale (bound {out16_tol:g})")
        loss.backward()
        check_grads(model, "bf16/grad/", grad16_tol)
    return report(workload, check.failures)


def report(workload, failures):
    if failures:
        print(f"{workload}: FAIL: the Python model differs from ampx-train's: {', '.join(failures)}")
        return 1
    print(f"{workload}: the Python model is ampx-train's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
