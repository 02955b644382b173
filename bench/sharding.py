#!/usr/bin/env python3
"""Bytes per parameter on each rank under ampx-train's --shard settings.

    bench/sharding.py [--build build/host] [--out runs/bench] [--worlds 1,2,4]
                      [--layers 12] [--wheel-build build/wheel --wheel-python PY]
                      [--anchor-layers 4]

One gpt whose parameters dominate its memory (GPT-2 small's blocks: 12 layers
of d 768, 85.2M parameters; context 64, 2 sequences per rank, so activations
are a few MiB a layer) trained 3 steps in O2 (bf16) with AdamW, by ampx-train
at every world size and sharding: none (DDP), optimizer (ZeRO-1), grad
(ZeRO-2), full (ZeRO-3). Each rank's peak of allocated tensor bytes
(ampx-train's tracking allocator, `rank_peak_bytes` in its result) over the
parameter count is the table, beside what rank 0 keeps between steps,
measured from its tensors after the last step (`weight_bytes`: weights and
gradients, under grad and full the fp32 shards and theirs; `optimizer_bytes`:
masters where the optimizer keeps them, moments), the most gathered
parameters it held at once (`gathered_bytes`) and the rest of the peak
(activations, DDP's buckets, the reduce-scatter's fp32 buffer, transients).

The expected bytes kept (O2, per parameter): DDP 2 (bf16 weights) + 2 (bf16
gradients) + 4 (fp32 masters) + 8 (AdamW's two moments) = 16, plus DDP's flat
gradient buckets; ZeRO-3 16/N (fp32 shards, their gradients, the moments),
and the gathered units: one block in bf16 (7.1M parameters, 14 MiB), two
while the next one's gather is in flight.
With --wheel-build and --wheel-python (as `make bench` passes them), a second
table sets ampx-train built against the wheel's LibTorch beside the anchor a
Python user picks instead, PyTorch's FSDP2 in the wheel's Python
(fsdp2_bench.py: fully_shard per block and root, bf16 gathers, fp32
reduce-scatters, fused AdamW), on the same model, initial weights, batches and
rows, 2 ranks, ZeRO-3 (`--shard full` / reshard_after_forward) and ZeRO-2
(`--shard grad` / no reshard): each seed of ANCHOR_SEEDS once per side,
interleaved; ANCHOR_STEPS steps each. Peak memory is counted the same way on
both sides (live bytes of c10's CPU allocator from the model's construction
on), the step time is the slowest rank's median after the warm-up.

run_all.py runs it as part `sharding`; alone, it prints the tables.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

LAYERS, D, HEADS, BLOCK, ROWS_PER_RANK, STEPS = 12, 768, 12, 64, 2, 3
ANCHOR_LAYERS = 4  # FSDP2's comparison: 20 steps x 3 seeds x 2 sides x 2 shardings
SHARDINGS = ["none", "optimizer", "grad", "full"]
ANCHOR_WORLD, ANCHOR_STEPS, ANCHOR_SEEDS = 2, 20, (1337, 1, 2)


def block_parameters():
    """One gpt block's parameters (apps/workloads/models.h): two LayerNorms,
    the qkv, proj, fc and out Linears: the largest unit of --shard full."""
    return 2 * 2 * D + (D * 3 * D + 3 * D) + (D * D + D) + (D * 4 * D + 4 * D) + (4 * D * D + D)


def gpt_parameters(vocab, layers=LAYERS):
    """gpt's parameter count: embedding, positions, the blocks, ln_f, head."""
    return vocab * D + BLOCK * D + layers * block_parameters() + 2 * D + (D * vocab + vocab)


def run_one(exe, out, world, shard, data_dir, steps=STEPS, seed=None, tag="", layers=LAYERS):
    name = f"shard-{shard}-{world}-{layers}l{tag}"
    result = os.path.join(out, name + ".json")
    cmd = [exe, "--workload", "gpt", "--precision", "O2", "--layers", str(layers),
           "--d-model", str(D), "--heads", str(HEADS), "--block-size", str(BLOCK),
           "--batch-size", str(ROWS_PER_RANK * world), "--steps", str(steps),
           "--eval-batches", "1", "--progress", "none", "--threads", "1",
           "--out-dir", os.path.join(out, name), "--result-file", result]
    if world > 1:
        cmd += ["--nproc", str(world), "--shard", shard]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    with open(result) as f:
        r = json.load(f)
    peaks = r.get("rank_peak_bytes") or [r["peak_bytes"]]
    return {"rank_peak_bytes": peaks, "median_step_ms": r.get("median_step_ms"),
            "losses": r.get("losses"), "weight_bytes": r.get("weight_bytes"),
            "optimizer_bytes": r.get("optimizer_bytes"),
            "gathered_bytes": r.get("gathered_bytes", 0)}


def run_fsdp2(python, out, shard, seed, data_dir, layers=ANCHOR_LAYERS):
    """fsdp2_bench.py at the anchor's settings: shard "full" (reshard after
    forward) or "grad" (keep the gathered units until backward)."""
    name = f"fsdp2-{shard}-{ANCHOR_WORLD}-seed{seed}"
    result = os.path.join(out, name + ".json")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "python", "fsdp2_bench.py")
    cmd = [python, script, "--world", str(ANCHOR_WORLD), "--layers", str(layers),
           "--d-model", str(D), "--heads", str(HEADS), "--block-size", str(BLOCK),
           "--batch-size", str(ROWS_PER_RANK * ANCHOR_WORLD), "--steps", str(ANCHOR_STEPS),
           "--seed", str(seed), "--threads", "1", "--json", result,
           "--reshard-after-forward", "true" if shard == "full" else "false"]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    env = dict(os.environ)
    env.pop("LD_LIBRARY_PATH", None)  # the wheel brings its own BLAS; Debian's is for 1.13
    for _ in range(2):  # once more if a rank fails (torch 2.15's CPU FSDP2 has aborted at exit)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode == 0:
            break
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    with open(result) as f:
        r = json.load(f)
    return {k: r[k] for k in ("rank_peak_bytes", "median_step_ms", "losses", "torch_version",
                              "memory_method", "runtime")}


def anchor(args, out):
    """ampx-train (wheel build) and FSDP2 (wheel Python) at 2 ranks, each seed
    once per side, interleaved; None without the wheel's arguments."""
    build, python = getattr(args, "wheel_build", None), getattr(args, "wheel_python", None)
    if not (build and python):
        return None
    exe = os.path.join(build, "apps", "ampx-train", "ampx-train")
    data_dir = getattr(args, "data_dir", None)
    layers = getattr(args, "anchor_layers", ANCHOR_LAYERS)
    runs = {}
    for shard in ("full", "grad"):
        for seed in ANCHOR_SEEDS:
            ampx = run_one(exe, out, ANCHOR_WORLD, shard, data_dir, steps=ANCHOR_STEPS, seed=seed,
                           tag=f"-wheel-seed{seed}", layers=layers)
            torch_ = run_fsdp2(python, out, shard, seed, data_dir, layers)
            runs[f"{shard}/{seed}"] = {"ampx": ampx, "fsdp2": torch_}
            print(f"sharding anchor: {shard} seed {seed}: ampx {ampx.get('median_step_ms')} ms, "
                  f"fsdp2 {torch_.get('median_step_ms')} ms", file=sys.stderr)
    return {"world": ANCHOR_WORLD, "steps": ANCHOR_STEPS, "seeds": list(ANCHOR_SEEDS),
            "layers": layers, "runs": runs}


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
    layers = getattr(args, "layers", LAYERS)
    runs = {}
    for world in worlds:
        for shard in (SHARDINGS if world > 1 else ["none"]):
            runs[f"{shard}/{world}"] = run_one(exe, out, world, shard,
                                              getattr(args, "data_dir", None), layers=layers)
            print(f"sharding: {shard} x{world}: {runs[f'{shard}/{world}']}", file=sys.stderr)
    vocab = vocab_of(getattr(args, "data_dir", None))
    return {"layers": layers, "d_model": D, "heads": HEADS, "block_size": BLOCK,
            "rows_per_rank": ROWS_PER_RANK, "steps": STEPS, "vocab": vocab,
            "parameters": gpt_parameters(vocab, layers) if vocab else None,
            "block_parameters": block_parameters(), "runs": runs,
            "anchor": anchor(args, out)}


def kept_bytes(r):
    """What rank 0 keeps between steps: weights, gradients, masters, moments."""
    return (r.get("weight_bytes") or 0) + (r.get("optimizer_bytes") or 0)


def target_lines(result):
    """Issue 64's memory target at each world size: ZeRO-3's per rank within
    10% of DDP's over N plus the largest unit's gathered size (one block in
    bf16), on what each rank keeps plus what it gathers, and on the peak."""
    n, runs = result["parameters"], result["runs"]
    unit = 2 * result["block_parameters"]
    lines = []
    for key, r in runs.items():
        shard, world = key.split("/")
        ddp = runs.get(f"none/{world}")
        if shard != "full" or not ddp or "error" in r or "error" in ddp:
            continue
        w = int(world)
        kept = kept_bytes(r) + r["gathered_bytes"]
        kept_mark = kept_bytes(ddp) / w + unit
        peak, peak_mark = max(r["rank_peak_bytes"]), max(ddp["rank_peak_bytes"]) / w + unit
        verdict = lambda got, mark: "met" if got <= 1.1 * mark else "missed"
        lines.append(f"- {w} ranks: kept and gathered {kept / n:.2f} B/param against DDP's "
                     f"{kept_bytes(ddp) / n:.2f} / {w} + one block {unit / n:.2f} = "
                     f"{kept_mark / n:.2f}: {kept / kept_mark:.2f}x, "
                     f"{verdict(kept, kept_mark)}; peak {peak / n:.2f} against "
                     f"{max(ddp['rank_peak_bytes']) / n:.2f} / {w} + {unit / n:.2f} = "
                     f"{peak_mark / n:.2f} (activations and buffers that do not shrink with "
                     f"the ranks divided too): {peak / peak_mark:.2f}x, "
                     f"{verdict(peak, peak_mark)}.")
    if lines:
        lines = ["Target (issue 64): ZeRO-3 within 1.10x of DDP's per rank over N plus the "
                 "largest unit gathered:", ""] + lines + [""]
    return lines


def report(result):
    if not result:
        return []
    n = result["parameters"]
    anchor_n = gpt_parameters(result["vocab"], result["anchor"].get("layers", LAYERS)) \
        if result.get("anchor") and result.get("vocab") else n
    if not result["runs"]:  # --worlds "": the FSDP2 comparison alone
        return report_anchor(result.get("anchor"), anchor_n)
    lines = [f"## Sharding: bytes per parameter on each rank (`bench/sharding.py`)", "",
             f"ampx-train gpt, O2 (bf16, AdamW), {result['layers']} layers of d "
             f"{result['d_model']} ({n / 1e6:.1f}M parameters), context {result['block_size']}, "
             f"{result['rows_per_rank']} sequences per rank, {result['steps']} steps, ranks on "
             "this machine over Gloo. Peak: each rank's most allocated tensor bytes (ampx's "
             "tracking allocator) over the parameter count, the largest rank's. Kept: rank 0's "
             "weights, gradients, masters and moments after the last step, measured from its "
             "tensors; gathered: the most gathered parameters rank 0 held at once; rest: the "
             "peak less both (activations, DDP's buckets, the reduce-scatter's fp32 buffer, "
             "transients).", "",
             "| ranks | sharding | peak B/param (largest rank) | kept | gathered | rest | "
             "per rank MiB | median step ms |",
             "| ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for key, r in result["runs"].items():
        shard, world = key.split("/")
        if "error" in r:
            lines.append(f"| {world} | {shard} | failed: {' '.join(r['error'])} | | | | | |")
            continue
        peaks = r["rank_peak_bytes"]
        mib = ", ".join(f"{p / 2**20:.0f}" for p in peaks)
        step = r.get("median_step_ms")
        kept, gathered = kept_bytes(r), r.get("gathered_bytes") or 0
        rest = peaks[0] - kept - gathered
        lines.append(f"| {world} | {shard} | {max(peaks) / n:.2f} | {kept / n:.2f} | "
                     f"{gathered / n:.2f} | {rest / n:.2f} | {mib} | "
                     + (f"{step:.0f} |" if step else "- |"))
    lines.append("")
    lines += target_lines(result)
    return lines + report_anchor(result.get("anchor"), anchor_n)


def final_loss(losses):
    """The run's train loss as ampx-train reports it: the mean of the last tenth of the steps."""
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def report_anchor(anchor, n):
    """The FSDP2 comparison's table and verdicts; nothing when it did not run."""
    if not anchor:
        return []
    first = next((r["fsdp2"] for r in anchor["runs"].values() if "error" not in r["fsdp2"]), {})
    rt = first.get("runtime", {})
    lines = [f"### Against PyTorch's FSDP2 ({anchor['world']} ranks)", "",
             f"A gpt of {anchor.get('layers', LAYERS)} layers of d {D}, O2 against FSDP2's `MixedPrecisionPolicy(param_dtype=bfloat16, "
             f"reduce_dtype=float32)` with `fully_shard` per block and on the root and "
             f"`torch.optim.AdamW(fused=True)` (bench/python/fsdp2_bench.py, torch "
             f"{first.get('torch_version', '?')}, fp32 BLAS {rt.get('fp32_blas', '?')}, ATen "
             f"{rt.get('aten_cpu_capability', '?')}), against ampx-train built on the same wheel's "
             f"LibTorch; {anchor['steps']} steps from the same initial weights and batches, seeds "
             f"{', '.join(map(str, anchor['seeds']))}, one thread a rank, interleaved. Memory: "
             f"{first.get('memory_method', 'see fsdp2_bench.py')} (ampx: its tracking allocator, "
             "the same allocations); the largest rank's, median over seeds. Step: the slowest "
             "rank's median, median over seeds. Loss: the last tenth's mean per seed; seed spread: "
             "the largest minus the smallest of FSDP2's.", "",
             "| sharding | ampx MiB | FSDP2 MiB | memory ampx / FSDP2 | ampx ms | FSDP2 ms | "
             "speed ampx vs FSDP2 | loss ampx / FSDP2 per seed | largest gap | seed spread |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for shard in ("full", "grad"):
        pairs = [anchor["runs"][f"{shard}/{seed}"] for seed in anchor["seeds"]]
        bad = [side for r in pairs for side in ("ampx", "fsdp2") if "error" in r[side]]
        if bad:
            errors = {side: r[side]["error"] for r in pairs for side in r if "error" in r[side]}
            lines.append(f"| {shard} | failed: {errors} | | | | | | | | |")
            continue
        med = lambda side, f: statistics.median(f(r[side]) for r in pairs)
        a_mem = med("ampx", lambda r: max(r["rank_peak_bytes"]))
        t_mem = med("fsdp2", lambda r: max(r["rank_peak_bytes"]))
        a_ms = med("ampx", lambda r: r["median_step_ms"])
        t_ms = med("fsdp2", lambda r: r["median_step_ms"])
        losses = [(final_loss(r["ampx"]["losses"]), final_loss(r["fsdp2"]["losses"]))
                  for r in pairs]
        gap = max(abs(a - t) for a, t in losses)
        spread = max(t for _, t in losses) - min(t for _, t in losses)
        lines.append(f"| {shard} | {a_mem / 2**20:.0f} ({a_mem / n:.2f} B/param) | "
                     f"{t_mem / 2**20:.0f} ({t_mem / n:.2f} B/param) | {a_mem / t_mem:.2f}x | "
                     f"{a_ms:.0f} | {t_ms:.0f} | {t_ms / a_ms:.2f}x | "
                     + ", ".join(f"{a:.4f} / {t:.4f}" for a, t in losses)
                     + f" | {gap:.4f} | {spread:.4f} |")
    lines += ["", "Targets (issue 64): memory ampx / FSDP2 <= 1.00x, speed >= 1.00x, the largest "
              "loss gap within the seed spread.", ""]
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(os.path.dirname(__file__), "..", "build",
                                                   "host"))
    p.add_argument("--out", default=os.path.join("runs", "bench"))
    p.add_argument("--worlds", default="1,2,4", help='the memory table\'s world sizes ("": none)')
    p.add_argument("--layers", type=int, default=LAYERS,
                   help="gpt blocks of the memory table (12: GPT-2 small's)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--wheel-build", default=None, help="ampx built on the wheel's LibTorch")
    p.add_argument("--wheel-python", default=None, help="the wheel's Python (FSDP2's side)")
    p.add_argument("--anchor-layers", type=int, default=ANCHOR_LAYERS,
                   help="gpt blocks of the FSDP2 comparison (4: the run of record's; 12: "
                        "GPT-2 small's, three times as long)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result = measure(args, args.out, [int(w) for w in args.worlds.split(",") if w])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print("\n".join(report(result)))


if __name__ == "__main__":
    main()
