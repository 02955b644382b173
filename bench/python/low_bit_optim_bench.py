#!/usr/bin/env python3
"""The anchor of ampx's low-bit optimizer state: torchao's AdamW8bit and
AdamWFp8 (and torch's AdamW, fused) stepping one bf16 parameter of --elements
elements in the wheel's Python, on the CPU, timed as ampx_optim_bench times
ampx's step (the step alone, after warm-up steps that also compile torchao's).

  ~/.cache/ampx/wheel-venv/bin/python bench/python/low_bit_optim_bench.py \
      [--elements 10000000] [--threads 2] [--steps 10]

Each optimizer steps a bf16 parameter whose gradient is fixed (torchao with
bf16_stochastic_round=True: no fp32 master, as ampx's --masters=stochastic);
torch's fused AdamW steps an fp32 parameter (what a user without torchao
picks). One JSON line per optimizer: name, ms per step (median), elements.
"""
import argparse
import json
import statistics
import time

import torch


def timed(opt, steps):
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=10_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from torchao.optim import AdamW8bit, AdamWFp8

    def param(dtype):
        g = torch.Generator().manual_seed(0)
        p = (torch.randn(a.elements, generator=g) * 0.1).to(dtype).requires_grad_()
        p.grad = (torch.randn(a.elements, generator=g) * 1e-3).to(dtype)
        return p

    cases = [
        ("torchao.AdamW8bit", lambda: AdamW8bit([param(torch.bfloat16)], lr=1e-4,
                                               bf16_stochastic_round=True)),
        ("torchao.AdamWFp8", lambda: AdamWFp8([param(torch.bfloat16)], lr=1e-4,
                                             bf16_stochastic_round=True)),
        ("torch.AdamW(fused=True) fp32", lambda: torch.optim.AdamW([param(torch.float32)],
                                                                   lr=1e-4, fused=True)),
    ]
    for name, make in cases:
        opt = make()
        for _ in range(a.warmup):
            opt.step()
        ms = timed(opt, a.steps)
        print(json.dumps({"optimizer": name, "ms_per_step": ms, "elements": a.elements,
                          "threads": a.threads, "torch": torch.__version__,
                          "cpu_capability": torch.backends.cpu.get_cpu_capability()}),
              flush=True)


if __name__ == "__main__":
    main()
