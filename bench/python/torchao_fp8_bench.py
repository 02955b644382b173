#!/usr/bin/env python3
"""torchao's FP8 training Linear against nn.Linear in fp32 and bf16 autocast,
on the CPU: the Python side of ampx's FP8 benchmark (bench/cpp/fp8_bench.cpp,
ampx_fp8_bench), with the same shapes and the same fields.

  /root/.cache/ampx/wheel-venv/bin/python bench/python/torchao_fp8_bench.py \\
      --tokens 1024 --iters 10 --threads 2

Layers, as ampx_fp8_bench's: the matrix shapes of a GPT-2-small block (d 768:
qkv 768->2304, proj 768->768, fc 768->3072, out 3072->768); --shapes
name:in:out,... gives others. Per shape, three layers with the same weights:
  fp32  nn.Linear, float32 input
  bf16  nn.Linear under torch.autocast("cpu", torch.bfloat16), bfloat16 input
  fp8   torchao.float8 Float8Linear, Float8LinearConfig(emulate=True): the
        default "tensorwise" recipe (dynamic per-tensor scales, E4M3 forward,
        E5M2 gradients), bfloat16 input (so bfloat16 output, as ampx's FP8
        layer under bf16 autocast gives), outside autocast: CPU autocast
        would run torchao's emulated float32 products in bfloat16. On the
        CPU torchao has no FP8 kernel; emulate=True multiplies the FP8
        values in float32 (torch.mm), as ampx's CPU emulation does.
Two timed units, interleaved per iteration (fp32, bf16, fp8, then again
with the optimizer), median over --iters after --warmup:
  <mode>_ms       forward + backward (y.backward(g), input gradient too):
                  what ampx_fp8_bench's bf16_ms / fp8_ms time; like it,
                  gradients accumulate across iterations
  <mode>_step_ms  a training step: zero_grad, forward, backward, optimizer
                  step (--optimizer, default AdamW, torch's CPU default
                  implementation)

One JSON object on stdout. Keys: tool, device ("cpu"), torch, torchao,
threads, tokens, iters, warmup, recipe ("tensorwise"), emulate (true),
optimizer, shapes: [{name, in, out, fp32_ms, bf16_ms, fp8_ms, speedup
(bf16_ms / fp8_ms, ampx_fp8_bench's), fp32_tflops, bf16_tflops, fp8_tflops
(6 * tokens * in * out / time: the forward and two backward products),
fp32_step_ms, bf16_step_ms, fp8_step_ms, step_speedup (bf16_step_ms /
fp8_step_ms)}], block_speedup and block_step_speedup (summed bf16 time over
summed fp8 time, ampx_fp8_bench's block_speedup), scaled_mm_calls (how many
FP8 products went to torch._scaled_mm, counted: 0 with the emulation, as
ampx_fp8_bench counts its own on the CPU).
"""
import argparse
import copy
import json
import statistics
import sys
import time

import torch

DEFAULT_SHAPES = "qkv:768:2304,proj:768:768,fc:768:3072,out:3072:768"  # ampx_fp8_bench's
MODES = ("fp32", "bf16", "fp8")


def parse_shapes(text):
    shapes = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 3:
            raise argparse.ArgumentTypeError("a shape is name:in:out, got %r" % item)
        name, fan_in, fan_out = parts
        try:
            fan_in, fan_out = int(fan_in), int(fan_out)
        except ValueError:
            raise argparse.ArgumentTypeError("in and out must be integers, got %r" % item)
        if fan_in <= 0 or fan_out <= 0:
            raise argparse.ArgumentTypeError("in and out must be > 0, got %r" % item)
        shapes.append((name, fan_in, fan_out))
    return shapes


def positive(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be > 0, got %s" % text)
    return value


def make_layers(fan_in, fan_out):
    """mode -> nn.Module, all three with the same initial weights."""
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    torch.manual_seed(0)
    plain = torch.nn.Linear(fan_in, fan_out)
    return {"fp32": copy.deepcopy(plain), "bf16": copy.deepcopy(plain),
            "fp8": Float8Linear.from_float(copy.deepcopy(plain),
                                           config=Float8LinearConfig(emulate=True))}


def make_optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    return torch.optim.SGD(params, lr=1e-4)


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def bench_shape(name, fan_in, fan_out, args):
    layers = make_layers(fan_in, fan_out)
    opts = {m: make_optimizer(args.optimizer, layers[m].parameters()) for m in MODES}
    x32 = torch.randn(args.tokens, fan_in)
    inputs = {"fp32": x32, "bf16": x32.to(torch.bfloat16), "fp8": x32.to(torch.bfloat16)}
    grads = {m: torch.randn(args.tokens, fan_out).to(inputs[m].dtype) for m in MODES}

    def fwd_bwd(mode):
        x = inputs[mode].detach().requires_grad_(True)
        if mode == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = layers[mode](x)
        else:
            y = layers[mode](x)
        y.backward(grads[mode].to(y.dtype))

    def step(mode):
        opts[mode].zero_grad()
        fwd_bwd(mode)
        opts[mode].step()

    times = {m: [] for m in MODES}
    step_times = {m: [] for m in MODES}
    for i in range(args.warmup + args.iters):
        for mode in MODES:  # interleaved: a slower stretch of the machine hits every mode
            t = timed(lambda: fwd_bwd(mode))
            if i >= args.warmup:
                times[mode].append(t)
        for mode in MODES:
            t = timed(lambda: step(mode))
            if i >= args.warmup:
                step_times[mode].append(t)
    flops = 6.0 * args.tokens * fan_in * fan_out  # forward and two backward products
    row = {"name": name, "in": fan_in, "out": fan_out}
    for mode in MODES:
        row[mode + "_ms"] = round(statistics.median(times[mode]), 4)
    row["speedup"] = round(row["bf16_ms"] / row["fp8_ms"], 3)
    for mode in MODES:
        row[mode + "_tflops"] = round(flops / row[mode + "_ms"] / 1e9, 4)
    for mode in MODES:
        row[mode + "_step_ms"] = round(statistics.median(step_times[mode]), 4)
    row["step_speedup"] = round(row["bf16_step_ms"] / row["fp8_step_ms"], 3)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=positive, default=1024,
                   help="rows of each layer's input (ampx_fp8_bench --tokens) [1024]")
    p.add_argument("--iters", type=positive, default=10, help="timed iterations per unit [10]")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first [3]")
    p.add_argument("--threads", type=positive, default=2, help="torch.set_num_threads [2]")
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES),
                   help="name:in:out,... [%s]" % DEFAULT_SHAPES)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="the training step's optimizer (lr 1e-4) [adamw]")
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    try:
        import torchao
        import torchao.float8  # noqa: F401
    except ImportError as e:
        sys.exit("torchao_fp8_bench: torchao is not installed for %s (%s): run it with the "
                 "wheel environment's Python (scripts/wheel-env.sh)" % (sys.executable, e))
    torch.set_num_threads(args.threads)
    # Counted, not assumed: torchao reaches torch._scaled_mm only without emulate.
    scaled_mm_calls = [0]
    scaled_mm = torch._scaled_mm

    def counting_scaled_mm(*a, **kw):
        scaled_mm_calls[0] += 1
        return scaled_mm(*a, **kw)

    torch._scaled_mm = counting_scaled_mm
    try:
        rows = [bench_shape(name, fan_in, fan_out, args) for name, fan_in, fan_out in args.shapes]
    finally:
        torch._scaled_mm = scaled_mm
    total = {m: sum(r[m + "_ms"] for r in rows) for m in MODES}
    total_step = {m: sum(r[m + "_step_ms"] for r in rows) for m in MODES}
    result = {
        "tool": "torchao_fp8_bench", "device": "cpu", "torch": torch.__version__,
        "torchao": torchao.__version__, "threads": args.threads, "tokens": args.tokens,
        "iters": args.iters, "warmup": args.warmup, "recipe": "tensorwise", "emulate": True,
        "optimizer": args.optimizer, "shapes": rows,
        "block_speedup": round(total["bf16"] / total["fp8"], 3),
        "block_step_speedup": round(total_step["bf16"] / total_step["fp8"], 3),
        "scaled_mm_calls": scaled_mm_calls[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
