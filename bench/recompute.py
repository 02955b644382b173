"""What ampx-train --recompute buys and costs, against Python's autocast on the same GPT.

For each round, interleaved: ampx-train --compare fp32,O2 with --recompute none, mlp and
blocks, then the wheel's Python (bench/python/torch_amp_bench.py) in autocast bf16, eager
and torch.compile'd, with AdamW(fused=True). Peak memory is each program's allocator peak of
live tensor bytes (ampx-train: ampx's tracking allocator; Python: its CPU allocator
profile, torch_amp_bench.py's peak_bytes), step time the median of the timed steps; the
table shows the median over rounds and the ratios of each round's runs, so the machine's
drift between rounds cancels. Only the standard library: run it under any python3.

    python3 bench/recompute.py --ampx-train build/wheel/apps/ampx-train/ampx-train \\
        --python build/wheel-venv/bin/python --workload gpt --rounds 3 --out runs/recompute
"""
import argparse
import json
import os
import statistics

import e2e
from harness import ROOT

RECOMPUTE = ["none", "mlp", "blocks"]


def e2e_args(args):
    """The flags e2e.py's runs read, from this script's."""
    return argparse.Namespace(threads=args.threads, gpt_steps=args.steps, image_steps=args.steps,
                              gpt_batch=None, data_dir=args.data_dir)


def ampx_run(args, workload, recompute, rnd):
    """fp32's and O2's step time and peak of ampx-train --recompute `recompute`."""
    c = e2e.ampx_train(args.ampx_train, e2e_args(args), args.out, workload, rnd,
                       tag=f"recompute-{recompute}", modes=["fp32", "O2"],
                       extra=["--recompute", recompute])
    return {m["mode"]: {"ms": m["median_step_ms"], "peak": m["peak_allocated_bytes"]}
            for m in c["modes"]}


def python_run(args, workload, compiled, rnd):
    r = e2e.python_amp(args.python, e2e_args(args), args.out, workload, "autocast-bf16", rnd=rnd,
                       compiled=compiled, adamw="fused")
    return {"ms": r["median_step_ms"], "peak": r["peak_bytes"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ampx-train", required=True, help="ampx-train built against the wheel")
    p.add_argument("--python", required=True, help="the wheel's Python (build/wheel-venv)")
    p.add_argument("--workload", choices=e2e.GPT_WORKLOADS, default="gpt")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "recompute"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    w = args.workload
    rounds = []
    for rnd in range(1, args.rounds + 1):
        r = {f"ampx {rc}": ampx_run(args, w, rc, rnd) for rc in RECOMPUTE}
        r["python eager"] = python_run(args, w, False, rnd)
        r["python compiled"] = python_run(args, w, True, rnd)
        rounds.append(r)
    with open(os.path.join(args.out, f"{w}.json"), "w") as f:
        json.dump(rounds, f, indent=1)

    def med(fn):
        return statistics.median(fn(r) for r in rounds)

    def low_python(r):  # Python autocast's lowest peak and that run's step time
        return min((r["python eager"], r["python compiled"]), key=lambda x: x["peak"])

    def best_python_ms(r):
        return min(r["python eager"]["ms"], r["python compiled"]["ms"])

    mib = 1 << 20
    print(f"\n{w}, {args.threads} threads, {args.steps} steps, median of {args.rounds} rounds\n")
    print("| ampx --recompute | fp32 ms | O2 ms | O2 vs none | O2 vs Python's best | fp32 MiB "
          "| O2 MiB | O2 vs ampx fp32 (none) | O2 vs Python autocast's lowest |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rc in RECOMPUTE:
        k = f"ampx {rc}"
        print(f"| {rc} | {med(lambda r: r[k]['fp32']['ms']):.1f} | "
              f"{med(lambda r: r[k]['O2']['ms']):.1f} | "
              f"{med(lambda r: r['ampx none']['O2']['ms'] / r[k]['O2']['ms']):.2f}x | "
              f"{med(lambda r: best_python_ms(r) / r[k]['O2']['ms']):.2f}x | "
              f"{med(lambda r: r[k]['fp32']['peak']) / mib:.1f} | "
              f"{med(lambda r: r[k]['O2']['peak']) / mib:.1f} | "
              f"{med(lambda r: r[k]['O2']['peak'] / r['ampx none']['fp32']['peak']):.3f}x | "
              f"{med(lambda r: r[k]['O2']['peak'] / low_python(r)['peak']):.3f}x |")
    for k in ("python eager", "python compiled"):
        print(f"| ({k}, autocast bf16, fused AdamW) | | {med(lambda r: r[k]['ms']):.1f} | | | "
              f"| {med(lambda r: r[k]['peak']) / mib:.1f} | | |")


if __name__ == "__main__":
    main()
