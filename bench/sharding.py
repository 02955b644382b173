#!/usr/bin/env python3
"""Bytes per parameter on each rank under ampx-train's --shard settings.

    bench/sharding.py [--build build/host] [--out runs/bench] [--worlds 1,2,4]

One gpt whose parameters dominate its memory (4 layers of d 768: 28.4M
parameters; context 64, 2 sequences per rank, so activations are a few MiB)
trained 3 steps in O2 (bf16) with AdamW, by ampx-train at every world size
and sharding: none (DDP), optimizer (ZeRO-1), grad (ZeRO-2), full (ZeRO-3).
Each rank's peak of allocated tensor bytes (ampx-train's tracking allocator,
`rank_peak_bytes` in its result) over the parameter count is the table.

The expected peaks (O2, B bytes per parameter): DDP 2 (bf16 weights) + 2
(bf16 gradients) + 4 (fp32 masters) + 8 (AdamW's two moments) = 16, plus
DDP's flat gradient buckets; ZeRO-3 16/N plus the largest gathered unit
(one block in bf16: 7.1M parameters, 14 MiB) and its gradients' buffers.
run_all.py runs it as part `sharding`; alone, it prints the table.
"""

import argparse
import json
import os
import subprocess
import sys

LAYERS, D, HEADS, BLOCK, ROWS_PER_RANK, STEPS = 4, 768, 12, 64, 2, 3
SHARDINGS = ["none", "optimizer", "grad", "full"]


def gpt_parameters(vocab):
    """gpt's parameter count (apps/workloads/models.h): embedding, positions,
    blocks of two LayerNorms, qkv, proj, fc and out Linears, ln_f, head."""
    block = 2 * 2 * D + (D * 3 * D + 3 * D) + (D * D + D) + (D * 4 * D + 4 * D) + (4 * D * D + D)
    return vocab * D + BLOCK * D + LAYERS * block + 2 * D + (D * vocab + vocab)


def run_one(exe, out, world, shard, data_dir):
    name = f"shard-{shard}-{world}"
    result = os.path.join(out, name + ".json")
    cmd = [exe, "--workload", "gpt", "--precision", "O2", "--layers", str(LAYERS),
           "--d-model", str(D), "--heads", str(HEADS), "--block-size", str(BLOCK),
           "--batch-size", str(ROWS_PER_RANK * world), "--steps", str(STEPS),
           "--eval-batches", "1", "--progress", "none", "--threads", "1",
           "--out-dir", os.path.join(out, name), "--result-file", result]
    if world > 1:
        cmd += ["--nproc", str(world), "--shard", shard]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    with open(result) as f:
        r = json.load(f)
    peaks = r.get("rank_peak_bytes") or [r["peak_bytes"]]
    return {"rank_peak_bytes": peaks, "median_step_ms": r.get("median_step_ms")}


def vocab_of(data_dir):
    """ampx-train's gpt vocabulary: the distinct bytes of the Moby Dick text."""
    root = data_dir or os.environ.get("AMPX_DATA_DIR") or os.path.expanduser("~/.cache/ampx/data")
    try:
        with open(os.path.join(root, "moby-dick", "data.txt"), "rb") as f:
            return len(set(f.read()))
    except OSError:
        return None


def measure(args, out, worlds=(1, 2, 4)):
    exe = os.path.join(args.build, "apps", "ampx-train", "ampx-train")
    runs = {}
    for world in worlds:
        for shard in (SHARDINGS if world > 1 else ["none"]):
            runs[f"{shard}/{world}"] = run_one(exe, out, world, shard,
                                              getattr(args, "data_dir", None))
            print(f"sharding: {shard} x{world}: {runs[f'{shard}/{world}']}", file=sys.stderr)
    vocab = vocab_of(getattr(args, "data_dir", None))
    return {"layers": LAYERS, "d_model": D, "heads": HEADS, "block_size": BLOCK,
            "rows_per_rank": ROWS_PER_RANK, "steps": STEPS, "vocab": vocab,
            "parameters": gpt_parameters(vocab) if vocab else None, "runs": runs}


def report(result):
    if not result:
        return []
    n = result["parameters"]
    lines = [f"## Sharding: bytes per parameter on each rank (`bench/sharding.py`)", "",
             f"ampx-train gpt, O2 (bf16, AdamW), {result['layers']} layers of d "
             f"{result['d_model']} ({n / 1e6:.1f}M parameters), context {result['block_size']}, "
             f"{result['rows_per_rank']} sequences per rank, {result['steps']} steps, ranks on "
             "this machine over Gloo. Each rank's peak of allocated tensor bytes (ampx's "
             "tracking allocator) over the parameter count; the largest rank's.", "",
             "| ranks | sharding | bytes/param (largest rank) | per rank MiB | median step ms |",
             "| ---: | --- | ---: | --- | ---: |"]
    for key, r in result["runs"].items():
        shard, world = key.split("/")
        if "error" in r:
            lines.append(f"| {world} | {shard} | failed: {' '.join(r['error'])} | | |")
            continue
        peaks = r["rank_peak_bytes"]
        mib = ", ".join(f"{p / 2**20:.0f}" for p in peaks)
        step = r.get("median_step_ms")
        lines.append(f"| {world} | {shard} | {max(peaks) / n:.2f} | {mib} | "
                     f"{step:.0f} |" if step else f"| {world} | {shard} | {max(peaks) / n:.2f} | "
                     f"{mib} | - |")
    lines.append("")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(os.path.dirname(__file__), "..", "build",
                                                   "host"))
    p.add_argument("--out", default=os.path.join("runs", "bench"))
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result = measure(args, args.out, [int(w) for w in args.worlds.split(",")])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print("\n".join(report(result)))


if __name__ == "__main__":
    main()
