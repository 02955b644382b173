#!/usr/bin/env python3
"""Bytes a parameter that the weights, gradients and optimizer hold, measured
by ampx-train at GPT-2 small's block shape, for each --masters and
--optimizer-state (issue 65's memory targets).

    bench/optimizer_bytes.py [--ampx-train build/host/apps/ampx-train/ampx-train]
                             [--out runs/optimizer-bytes] [--steps 2]

The model: ampx-train's gpt with GPT-2 small's blocks (12 layers, d 768, 12
heads; a character vocabulary, so 85M parameters instead of 124M: the
blocks are 99.9% of them), context 64, one sequence a step, 1 thread. After
the last step ampx-train counts, from the tensors themselves, the
optimizer's (`optimizer_bytes`: masters, compensations, moments and their
block scales, MixedPrecisionOptimizer::state_bytes) and the model's
parameters and gradients (`weight_and_grad_bytes`); the table divides each
by the parameter count. Targets (issue 65): at most 6.5 bytes a parameter
with stochastically rounded bf16 weights and 8-bit moments, at most 8.5 with
Kahan-compensated bf16 weights and 8-bit moments, and fp32 AdamW under O2
keeping at least 16.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = ["--workload", "gpt", "--layers", "12", "--d-model", "768", "--heads", "12",
         "--block-size", "64", "--batch-size", "1", "--eval-batches", "1", "--threads", "1",
         "--progress", "none"]

# (precision, masters, optimizer state, target: (bound, "max" | "min") or None)
CASES = [
    ("O2", "fp32", "fp32", (16.0, "min")),
    ("O2", "fp32", "8bit", None),
    ("O2", "kahan", "fp32", None),
    ("O2", "kahan", "8bit", (8.5, "max")),
    ("O2", "kahan", "fp8", (8.5, "max")),
    ("O3", "stochastic", "bf16", None),
    ("O3", "stochastic", "8bit", (6.5, "max")),
    ("O3", "stochastic", "fp8", (6.5, "max")),
]


def measure(ampx_train, out, precision, masters, state, steps):
    run_dir = os.path.join(out, f"{precision}-{masters}-{state}")
    cmd = [ampx_train, *SHAPE, "--precision", precision, "--masters", masters,
           "--optimizer-state", state, "--steps", str(steps), "--out-dir", run_dir]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "compare.json")) as f:
        return json.load(f)["modes"][0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ampx-train", default=os.path.join(ROOT, "build/host/apps/ampx-train/ampx-train"))
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "optimizer-bytes"))
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args()
    rows = []
    print("| precision | masters | moments | optimizer B/param | weights + grads B/param "
          "| total B/param | target |")
    print("| --- | --- | --- | ---: | ---: | ---: | --- |")
    for precision, masters, state, target in CASES:
        mode = measure(a.ampx_train, a.out, precision, masters, state, a.steps)
        params = mode["params"]
        optimizer = mode["optimizer_bytes"] / params
        weights = mode["weight_and_grad_bytes"] / params
        total = optimizer + weights
        verdict = ""
        if target:
            bound, kind = target
            met = total <= bound if kind == "max" else total >= bound
            verdict = f"{'<=' if kind == 'max' else '>='} {bound}: {'met' if met else 'missed'}"
        rows.append({"precision": precision, "masters": masters, "state": state,
                     "params": params, "optimizer_bytes_per_param": optimizer,
                     "weight_and_grad_bytes_per_param": weights, "total": total,
                     "target": verdict})
        print(f"| {precision} | {masters} | {state} | {optimizer:.3f} | {weights:.3f} "
              f"| {total:.3f} | {verdict} |", flush=True)
    with open(os.path.join(a.out, "optimizer-bytes.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
