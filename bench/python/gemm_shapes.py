#!/usr/bin/env python3
"""The gpt step's matrix products against the square-GEMM peak, per shape.

    LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-openmp \\
        /usr/bin/python3 bench/python/gemm_shapes.py [--dtype fp32|bf16] [--threads 2]
        [--batch 32] [--block 128] [--d-model 256] [--vocab 85] [--reps 20]

For ampx-train's gpt (4 layers; per layer qkv, proj, fc and out Linear layers;
the head once) it times every product a training step runs through the
Linear layers: forward y = x W^T (M = batch * block rows), backward
dx = dy W and dW = dy^T x, each as torch.mm into a preallocated output
(median of --reps after a warm-up), and the square products 1024^3 and
2048^3 as the peak. It prints each shape's GFLOP/s and share of the peak,
and the step's Linear products' time-weighted efficiency: how far the
products alone keep MFU below 100%. Attention's products are not Linear
layers (ampx's fused kernel runs them); they are left out.

Run it with the BLAS and threads the benchmarks use (make bench's
LD_LIBRARY_PATH), on a quiet machine.
"""
import argparse
import statistics
import time

import torch


def timed_mm(m, n, k, dtype, reps, trans_a=False):
    a = torch.randn(k, m, dtype=dtype).t() if trans_a else torch.randn(m, k, dtype=dtype)
    b = torch.randn(k, n, dtype=dtype)
    out = torch.empty(m, n, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--vocab", type=int, default=85)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    M, d = args.batch * args.block, args.d_model
    peak = 0.0
    for n in (1024, 2048):
        s = timed_mm(n, n, n, dtype, max(3, args.reps // 4))
        peak = max(peak, 2 * n ** 3 / s / 1e9)
    print(f"torch {torch.__version__}, {args.dtype}, {args.threads} threads, "
          f"square peak {peak:.1f} GFLOP/s")
    layers = [("qkv", d, 3 * d, args.layers), ("proj", d, d, args.layers),
              ("fc", d, 4 * d, args.layers), ("out", 4 * d, d, args.layers),
              ("head", d, args.vocab, 1)]
    print(f"{'product':<14}{'M':>6}{'N':>6}{'K':>6}{'GFLOP/s':>10}{'of peak':>9}{'ms/step':>9}")
    total_flop = total_s = 0.0
    for name, fan_in, fan_out, count in layers:
        for what, (m, n, k, trans_a) in (("fwd", (M, fan_out, fan_in, False)),
                                         ("dx", (M, fan_in, fan_out, False)),
                                         ("dW", (fan_out, fan_in, M, True))):
            s = timed_mm(m, n, k, dtype, args.reps, trans_a)
            flop = 2.0 * m * n * k
            total_flop += flop * count
            total_s += s * count
            print(f"{name + ' ' + what:<14}{m:>6}{n:>6}{k:>6}{flop / s / 1e9:>10.1f}"
                  f"{flop / s / 1e9 / peak:>8.0%}{s * count * 1e3:>9.2f}")
    print(f"Linear products of a step: {total_flop / 1e9:.2f} GFLOP in {total_s * 1e3:.1f} ms, "
          f"{total_flop / total_s / 1e9:.1f} GFLOP/s = {total_flop / total_s / 1e9 / peak:.0%} "
          f"of the square peak")


if __name__ == "__main__":
    main()
