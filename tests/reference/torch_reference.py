#!/usr/bin/env python3
"""Reference values from PyTorch itself (Debian's python3-torch) for ampx's tests.

Run with the interpreter whose torch matches the LibTorch under test (the
host's /usr/bin/python3 for LibTorch 1.13, the trixie chroot's for 2.6).

  torch_reference.py generate OUT_DIR     write every reference file
  torch_reference.py check-state FILE     verify a GradScaler state ampx saved

Files written:
  autocast_dtypes.json   output dtype of each op under torch.autocast("cpu")
  scaler_sequences.json  loss-scale trajectories over random overflow patterns
                         (600 to 10^4 steps), from the update rule written out
                         below and, on torch 2.3+, from torch.amp.GradScaler
                         itself for every rule PyTorch can express
  python_scaler_state.pt a GradScaler state dict saved with torch.save
  python_scaler_state.json  the values that file holds
  format_limits.json     torch.finfo of float16, bfloat16 (and the float8 formats
                         where torch has them) and each format's rounding
                         boundaries, found by casting float32 values with torch
"""
import json
import os
import random
import sys

import torch
import torch.nn.functional as F

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
# Rounding a Python float to float32 (nearest even, inf beyond), shared.
from fp8_reference import f32  # noqa: E402


# ---------------------------------------------------------------- autocast
def autocast_ops():
    """Ops by name; each takes a generator-seeded set of fp32 CPU inputs.
    tests/autocast/autocast_test.cpp has the same names and the same calls."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    a, b = r(8, 8), r(8, 8)
    a3, b3 = r(2, 8, 8), r(2, 8, 8)
    img, w2d = r(1, 3, 8, 8), r(4, 3, 3, 3)
    sig, w1d = r(1, 3, 16), r(4, 3, 3)
    wt2d = r(3, 4, 3, 3)
    logits, target = r(4, 5), torch.tensor([0, 1, 2, 3])
    prob = torch.sigmoid(r(4, 5))
    low = a.to(torch.bfloat16)
    return {
        "mm": lambda: torch.mm(a, b),
        "matmul": lambda: torch.matmul(a, b),
        "linear": lambda: F.linear(a, b),
        "bmm": lambda: torch.bmm(a3, b3),
        "addmm": lambda: torch.addmm(a, a, b),
        "baddbmm": lambda: torch.baddbmm(a3, a3, b3),
        "conv1d": lambda: F.conv1d(sig, w1d),
        "conv2d": lambda: F.conv2d(img, w2d),
        "conv_transpose2d": lambda: F.conv_transpose2d(img, wt2d),
        "relu": lambda: torch.relu(a),
        "exp": lambda: torch.exp(a),
        "log_softmax": lambda: torch.log_softmax(a, 1),
        "softmax": lambda: torch.softmax(a, 1),
        "layer_norm": lambda: F.layer_norm(a, [8]),
        "group_norm": lambda: F.group_norm(img, 3),
        "batch_norm": lambda: F.batch_norm(img, None, None, training=True),
        "mse_loss": lambda: F.mse_loss(a, b),
        "l1_loss": lambda: F.l1_loss(a, b),
        "cross_entropy": lambda: F.cross_entropy(logits, target),
        "nll_loss": lambda: F.nll_loss(logits, target),
        "binary_cross_entropy": lambda: F.binary_cross_entropy(prob, prob),
        "cdist": lambda: torch.cdist(a, b),
        "prod": lambda: torch.prod(a),
        "sum": lambda: torch.sum(a),
        "cat_mixed": lambda: torch.cat([a, low]),
        "stack_mixed": lambda: torch.stack([a, low]),
        "mm_of_low": lambda: torch.mm(low, low),
        "softmax_of_low": lambda: torch.softmax(low, 1),
        "mse_loss_of_low": lambda: F.mse_loss(low, low),
        "layer_norm_of_low": lambda: F.layer_norm(low, [8]),
    }


def dtype_name(t):
    return str(t.dtype).replace("torch.", "")


def autocast_dtypes():
    dtypes = [torch.bfloat16]
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.mm(torch.ones(2, 2), torch.ones(2, 2))
        if torch.get_autocast_cpu_dtype() is not None:
            dtypes.append(torch.float16)
    except Exception:  # 1.13: CPU autocast is bfloat16 only
        pass
    out = {}
    for dt in dtypes:
        res = {}
        for name, fn in autocast_ops().items():
            with torch.autocast("cpu", dtype=dt):
                y = fn()
            res[name] = dtype_name(y)
        out[dtype_name(torch.empty(0, dtype=dt))] = res
    return out


# ---------------------------------------------------------------- scaler
def model_update(state, found, rule):
    """The update rule, written from its definition (ampx/kernels.h), with
    PyTorch's arithmetic: products in double, stored as float32."""
    scale, growth, hyst = state
    if found:
        growth = 0
        hyst = max(hyst - 1, 0)
        if hyst == 0:
            scale = f32(scale * rule["backoff_factor"])
    else:
        successful = growth + 1
        if successful == rule["growth_interval"]:
            grown = f32(scale * rule["growth_factor"])
            if grown not in (float("inf"), float("-inf")) and grown == grown:
                scale = grown
            growth = 0
            hyst = rule["hysteresis"]
        else:
            growth = successful
    if rule["min_scale"] is not None:
        scale = max(scale, f32(rule["min_scale"]))
    if rule["max_scale"] is not None:
        scale = min(scale, f32(rule["max_scale"]))
    return scale, growth, hyst


def torch_has_cpu_scaler():
    """torch.amp.GradScaler runs on the CPU from 2.3 on; 1.13 has only
    torch.cuda.amp.GradScaler."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 3)


def torch_expressible(rule):
    """Rules torch.amp.GradScaler can run: no hysteresis, no scale bounds."""
    return rule["hysteresis"] == 1 and rule["min_scale"] is None and rule["max_scale"] is None


def torch_scaler_trajectory(rule, pattern):
    """Drive PyTorch's own GradScaler on the CPU with real gradients: a
    gradient of inf on overflow steps, 1 otherwise. Every option is passed
    explicitly and nothing else is set, so the trajectory is that of
    torch's defaults for whatever a rule does not name."""
    scaler = torch.amp.GradScaler("cpu", init_scale=rule["init_scale"],
                                  growth_factor=rule["growth_factor"],
                                  backoff_factor=rule["backoff_factor"],
                                  growth_interval=rule["growth_interval"])
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.0)
    inf_grad, one_grad = torch.full((3,), float("inf")), torch.ones(3)
    out = []
    for found in pattern:
        scaler.scale(torch.ones(()))
        p.grad = (inf_grad if found else one_grad).clone()
        scaler.step(opt)
        scaler.update()
        out.append([scaler.get_scale(), int(scaler._get_growth_tracker())])
    return out


def long_climbing_pattern(rng, steps, interval):
    """Overflows rare enough that the scale climbs by orders of magnitude
    between them, with bursts of overflows now and then."""
    pattern, step = [], 0
    while step < steps:
        if rng.random() < 1.0 / (40 * interval):  # a burst of 1-4 overflows
            burst = rng.randint(1, 4)
            pattern += [True] * burst
            step += burst
        else:
            pattern.append(rng.random() < 0.05 / interval)
            step += 1
    return pattern[:steps]


def scaler_rules(rng):
    """(rule, pattern) pairs: short random patterns over many factor pairs,
    hysteresis and bounds (ampx's extensions), and 10^4-step patterns in
    which the scale passes 2^24 and 2^64 (tests that the defaults put no
    ceiling where PyTorch has none)."""
    out = []
    for interval in (1, 3, 7, 50):
        for gf, bf in ((2.0, 0.5), (1.5, 0.7), (3.0, 0.25)):
            rule = dict(init_scale=65536.0, growth_factor=gf, backoff_factor=bf,
                        growth_interval=interval, hysteresis=1,
                        min_scale=None, max_scale=None)
            p_overflow = rng.choice((0.02, 0.1, 0.3, 0.6))
            out.append((rule, [rng.random() < p_overflow for _ in range(600)]))
    for hyst in (2, 3):
        rule = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5,
                    growth_interval=4, hysteresis=hyst, min_scale=None, max_scale=None)
        out.append((rule, [rng.random() < 0.3 for _ in range(600)]))
    rule = dict(init_scale=256.0, growth_factor=2.0, backoff_factor=0.5,
                growth_interval=2, hysteresis=1, min_scale=32.0, max_scale=4096.0)
    out.append((rule, [rng.random() < 0.3 for _ in range(600)]))
    rule = dict(init_scale=2.0 ** 120, growth_factor=2.0 ** 4, backoff_factor=0.5,
                growth_interval=1, hysteresis=2, min_scale=1.0, max_scale=None)
    out.append((rule, [rng.random() < 0.1 for _ in range(600)]))
    # Apex's ceiling, set explicitly, on a climbing pattern.
    rule = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5,
                growth_interval=3, hysteresis=1, min_scale=None, max_scale=2.0 ** 24)
    out.append((rule, long_climbing_pattern(rng, 2000, 3)))
    for interval, gf, bf in ((1, 2.0, 0.5), (3, 2.0, 0.5), (3, 1.5, 0.7), (10, 4.0, 0.25),
                             (25, 2.0, 0.125), (100, 8.0, 0.5)):
        rule = dict(init_scale=1024.0, growth_factor=gf, backoff_factor=bf,
                    growth_interval=interval, hysteresis=1, min_scale=None, max_scale=None)
        out.append((rule, long_climbing_pattern(rng, 10000, interval)))
    return out


def scaler_sequences():
    rng = random.Random(1234)
    with_torch = torch_has_cpu_scaler()
    cases = []
    for rule, pattern in scaler_rules(rng):
        state = (f32(rule["init_scale"]), 0, rule["hysteresis"])
        expected = []
        for found in pattern:
            state = model_update(state, found, rule)
            expected.append(list(state))
        checked = with_torch and torch_expressible(rule)
        if checked:
            ref = torch_scaler_trajectory(rule, pattern)
            for step, (mine, theirs) in enumerate(zip(expected, ref)):
                if mine[0] != theirs[0] or mine[1] != theirs[1]:
                    sys.exit("reference model disagrees with torch.amp.GradScaler at step %d: "
                             "%r vs %r for %r" % (step, mine, theirs, rule))
        if len(pattern) >= 10000 and rule["max_scale"] is None:
            peak = max(s for s, _, _ in expected)
            if peak <= 2.0 ** 64:
                sys.exit("long case never passes 2^64 (peak %r): %r" % (peak, rule))
        cases.append(dict(rule=rule, found_inf=[int(x) for x in pattern], expected=expected,
                          checked_against_torch=checked))
    return dict(torch_version=torch.__version__, torch_scaler_used=with_torch, cases=cases)


PY_STATE = {"scale": 1024.0, "growth_factor": 3.0, "backoff_factor": 0.25,
            "growth_interval": 7, "_growth_tracker": 3}


def python_scaler_state(out_dir):
    """Save a state dict the way Python users do: torch.save(scaler.state_dict())."""
    state = dict(PY_STATE)
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        try:
            scaler = torch.amp.GradScaler("cpu", init_scale=4096.0, growth_factor=3.0,
                                          backoff_factor=0.25, growth_interval=7)
            p = torch.nn.Parameter(torch.zeros(2))
            opt = torch.optim.SGD([p], lr=0.0)
            for found in (True, False, False, False):  # 4096 * 0.25 = 1024, tracker 3
                scaler.scale(torch.ones(()))
                p.grad = torch.full((2,), float("inf") if found else 1.0)
                scaler.step(opt)
                scaler.update()
            state = scaler.state_dict()
            assert state == PY_STATE, state
        except RuntimeError:
            pass
    torch.save(state, os.path.join(out_dir, "python_scaler_state.pt"))
    with open(os.path.join(out_dir, "python_scaler_state.json"), "w") as f:
        json.dump(state, f)


def check_state(path):
    """The file ampx's interop_save wrote: PyTorch must read it as a dict with
    PyTorch's keys and types, and (2.3+) load it into its own GradScaler."""
    # weights_only=True is the default from 2.6 on; 1.13's restricted unpickler
    # cannot read floats at all (its own GradScaler state included).
    safe = int(torch.__version__.split(".")[0]) >= 2
    state = torch.load(path, weights_only=True) if safe else torch.load(path)
    expected = {"scale": 512.0, "growth_factor": 4.0, "backoff_factor": 0.125,
                "growth_interval": 11, "_growth_tracker": 5}
    for key, value in expected.items():
        assert key in state, "missing %s in %r" % (key, state)
        assert type(state[key]) is type(value), (key, type(state[key]))
        assert state[key] == value, (key, state[key], value)
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        try:
            scaler = torch.amp.GradScaler("cpu")
        except RuntimeError:
            scaler = None
        if scaler is not None:
            scaler.load_state_dict(state)
            assert scaler.get_scale() == 512.0
            assert scaler.get_growth_factor() == 4.0
            assert scaler._get_growth_tracker() == 5
            print("loaded into torch.amp.GradScaler: scale", scaler.get_scale())
    print("ampx state read by torch", torch.__version__, ":", state)


# ---------------------------------------------------------------- formats
def _f32_of_bits(u):
    return torch.tensor([u], dtype=torch.int32).view(torch.float32)


def _first_bits(lo, hi, pred):
    """Smallest float32 bit pattern u in [lo, hi] with pred(value) true
    (pred is monotone in u over positive floats)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(_f32_of_bits(mid)):
            hi = mid
        else:
            lo = mid + 1
    return lo


def format_limits():
    formats = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            formats[name] = getattr(torch, name)
    out = {}
    for name, dtype in formats.items():
        info = torch.finfo(dtype)
        as_int = torch.int16 if info.bits == 16 else torch.uint8
        min_sub = float(torch.tensor([1], dtype=as_int).view(dtype).float())

        def cast(x):
            return x.to(dtype).float()

        inf_bits = 0x7F800000
        overflow = _first_bits(1, inf_bits, lambda x: not bool(torch.isfinite(cast(x))))
        above_zero = _first_bits(1, inf_bits, lambda x: float(cast(x)) > 0)
        normal = _first_bits(1, inf_bits, lambda x: float(cast(x)) >= info.tiny)
        out[name] = dict(max=float(info.max), tiny=float(info.tiny), min_subnormal=min_sub,
                         overflow_from_bits=overflow, zero_up_to_bits=above_zero - 1,
                         normal_from_bits=normal)
    return dict(torch_version=torch.__version__, formats=out)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "generate":
        out = sys.argv[2]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "autocast_dtypes.json"), "w") as f:
            json.dump(dict(torch_version=torch.__version__, dtypes=autocast_dtypes()), f, indent=1)
        with open(os.path.join(out, "scaler_sequences.json"), "w") as f:
            json.dump(scaler_sequences(), f)
        python_scaler_state(out)
        with open(os.path.join(out, "format_limits.json"), "w") as f:
            json.dump(format_limits(), f, indent=1)
        print("reference files from torch", torch.__version__, "in", out)
    elif len(sys.argv) == 3 and sys.argv[1] == "check-state":
        check_state(sys.argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
