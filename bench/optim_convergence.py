"""Convergence of the optimizer-state formats and master-weight keepers (issue 65, "Proof:
convergence"): ampx-train once per workload, combination and seed, and a table of the final
test losses against fp32 masters with fp32 state.

    python3 bench/optim_convergence.py --ampx-train build-wheel/apps/ampx-train/ampx-train \\
        --workloads gpt --steps 1000 --seeds 1 2 3 --threads 1 --out runs/optim-convergence

Every combination runs --precision O2 (bf16 weights; the norms and the rest as O2 keeps them),
changing only --masters and --optimizer-state, so the baseline is O2's own defaults (fp32
masters, fp32 moments). A run's final test loss is compare.json's test_loss (ampx-train's
end-of-run evaluation: gpt, --eval-batches held-out batches; the image workloads, the test split).

"same-seed differences" are each seed's test loss less the baseline's of that seed (the same
initial weights and batches: only the format differs).

Targets (the issue's): bf16 state and Kahan masters within the seed spread, i.e. |mean - the
baseline's mean| <= the baseline's max - min over its seeds; 8-bit and FP8 state (with any
masters) within 0.5% of the baseline's mean.

Resumable: a run whose result.json exists is read, not rerun; ampx-train writes into a scratch
folder that becomes the run's only once it finished, so a killed run starts over. Runs are
sequential, in the order of COMBOS then seeds: cut short, it leaves whole combinations.

With <out>/anchor/*.json (bench/python/low_bit_optim_convergence.py's results) a second gpt
table sets torchao's AdamW8bit and AdamWFp8 (and torch's AdamW) beside ampx's run of the same
seed, steps and moments format (fp32 masters), against the same seed spread.

Writes <out>/<workload>-<steps>/<masters>-<state>/seed<S>/result.json per run, and
<out>/<workload>-<steps>/convergence.json (its runs) and convergence.md (its table).

Only the standard library: the orchestration runs under any python3.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

# (masters, optimizer state); the first is the baseline. All under --precision O2.
COMBOS = [("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "fp8"), ("fp32", "8bit"),
          ("kahan", "fp32"), ("kahan", "8bit"), ("stochastic", "8bit")]
BASELINE = COMBOS[0]
PRECISION = "O2"
REL_TARGET = 0.005  # 8-bit and FP8 state: within 0.5% of the baseline
# bench/python/low_bit_optim_convergence.py's optimizers and the ampx combination each anchors:
# fp32 parameters under bf16 autocast against O2's bf16 weights with fp32 masters.
ANCHORS = {"torchao-adamw8bit": ("fp32", "8bit"), "torchao-adamwfp8": ("fp32", "fp8"),
           "torch-adamw": ("fp32", "fp32")}


def log(*a):
    print("[convergence]", *a, file=sys.stderr, flush=True)


def target_of(masters, state):
    """The issue's target for a combination: 'spread', 'rel' or None (the baseline)."""
    if (masters, state) == BASELINE:
        return None
    if state in ("8bit", "fp8"):
        return "rel"
    return "spread"  # bf16 state, Kahan masters with fp32 state


def run_dir(out, workload, steps, masters, state, seed):
    return os.path.join(out, f"{workload}-{steps}", f"{masters}-{state}", f"seed{seed}")


def run_one(args, workload, masters, state, seed):
    """One ampx-train run, or its stored result; returns the result dict."""
    d = run_dir(args.out, workload, args.steps, masters, state, seed)
    path = os.path.join(d, "result.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    scratch = d + ".partial"
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    cmd = [args.ampx_train, "--workload", workload, "--precision", PRECISION,
           "--masters", masters, "--optimizer-state", state, "--steps", str(args.steps),
           "--seed", str(seed), "--threads", str(args.threads), "--progress", "none",
           "--out-dir", scratch]
    log(" ".join(cmd))
    t0 = time.time()
    with open(os.path.join(scratch, "stdout.log"), "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    if rc != 0:
        sys.exit(f"ampx-train failed (exit {rc}): see {scratch}/stdout.log")
    with open(os.path.join(scratch, "compare.json")) as f:
        compare = json.load(f)
    mode = compare["modes"][0]
    result = {"workload": workload, "precision": PRECISION, "masters": masters,
              "optimizer_state": state, "seed": seed, "steps": mode["steps"],
              "test_loss": mode["test_loss"], "train_loss": mode["train_loss"],
              "skipped_steps": mode["skipped_steps"],
              "optimizer_bytes_per_param": mode["optimizer_bytes_per_param"],
              "wall_s": wall, "command": cmd, "machine": compare["machine"]}
    with open(os.path.join(scratch, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    shutil.rmtree(d, ignore_errors=True)
    os.rename(scratch, d)
    log(f"{workload} {masters}/{state} seed {seed}: test loss {mode['test_loss']:.4f} "
        f"({wall:.0f} s)")
    return result


def stored(args, workload, masters, state):
    """The finished runs of a combination, in seed order."""
    out = []
    for seed in args.seeds:
        path = os.path.join(run_dir(args.out, workload, args.steps, masters, state, seed),
                            "result.json")
        if os.path.exists(path):
            with open(path) as f:
                out.append(json.load(f))
    return out


def table(args, workload):
    """The markdown table of one workload from its stored runs."""
    base_runs = {r["seed"]: r["test_loss"] for r in stored(args, workload, *BASELINE)}
    base = list(base_runs.values())
    lines = [f"{workload}, {args.steps} steps, --precision {PRECISION}, seeds "
             f"{' '.join(map(str, args.seeds))}:", "",
             "| masters | optimizer state | seeds | mean test loss | min-max | vs fp32/fp32 "
             "| same-seed differences | target | met |", "|---|---|---|---|---|---|---|---|---|"]
    if not base:
        return lines + ["(no baseline runs)"]
    b_mean = statistics.mean(base)
    spread = max(base) - min(base)
    for masters, state in COMBOS:
        runs = stored(args, workload, masters, state)
        losses = [r["test_loss"] for r in runs]
        if not losses:
            lines.append(f"| {masters} | {state} | 0 | not run | | | | | |")
            continue
        # The same seed: the same initial weights and batches, only the format differs.
        paired = " ".join(f"{r['test_loss'] - base_runs[r['seed']]:+.4f}" for r in runs
                          if r["seed"] in base_runs)
        mean = statistics.mean(losses)
        rel = (mean - b_mean) / b_mean
        kind = target_of(masters, state)
        if kind is None:
            target, met = f"(spread {spread:.4f})", ""
        elif kind == "rel":
            target, met = f"within {REL_TARGET:.1%}", abs(rel) <= REL_TARGET
        else:
            target, met = f"within spread {spread:.4f}", abs(mean - b_mean) <= spread
        if met != "":
            met = ("yes" if met else "no")
            if len(losses) < len(args.seeds) or len(base) < len(args.seeds):
                met += " (partial seeds)"
        lines.append(f"| {masters} | {state} | {len(losses)} | {mean:.4f} | "
                     f"{min(losses):.4f}-{max(losses):.4f} | {rel:+.2%} "
                     f"({mean - b_mean:+.4f}) | {paired} | {target} | {met} |")
    return lines


def anchor_table(args, workload):
    """torchao's (and torch's) runs of bench/python/low_bit_optim_convergence.py in
    <out>/anchor/*.json beside ampx's run of the same seed and combination."""
    d = os.path.join(args.out, "anchor")
    if workload != "gpt" or not os.path.isdir(d):
        return []
    base = [r["test_loss"] for r in stored(args, workload, *BASELINE)]
    spread = max(base) - min(base) if base else None
    lines = [f"Against the anchor (gpt, {args.steps} steps; the seed spread is ampx's fp32/fp32 "
             f"max - min over seeds {' '.join(map(str, args.seeds))}"
             + (f": {spread:.4f}" if spread is not None else "") + "):", "",
             "| anchor | seed | anchor test loss | ampx masters / state | ampx test loss "
             "| ampx - anchor | within spread |", "|---|---|---|---|---|---|---|"]
    for name in sorted(os.listdir(d)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(d, name)) as f:
            a = json.load(f)
        if a["steps"] != args.steps or a["optimizer"] not in ANCHORS:
            continue
        masters, state = ANCHORS[a["optimizer"]]
        mine = [r for r in stored(args, workload, masters, state) if r["seed"] == a["seed"]]
        if not mine:
            lines.append(f"| {a['optimizer']} | {a['seed']} | {a['test_loss']:.4f} | "
                         f"{masters} / {state} | not run | | |")
            continue
        diff = mine[0]["test_loss"] - a["test_loss"]
        within = "" if spread is None else ("yes" if abs(diff) <= spread else "no")
        lines.append(f"| {a['optimizer']} (torch {a['torch_version']}, torchao "
                     f"{a['torchao_version']}) | {a['seed']} | {a['test_loss']:.4f} | "
                     f"{masters} / {state} | {mine[0]['test_loss']:.4f} | "
                     f"{diff:+.4f} ({diff / a['test_loss']:+.2%}) | {within} |")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ampx-train", required=True, help="the ampx-train program")
    p.add_argument("--workloads", nargs="+", default=["gpt"],
                   choices=["gpt", "gpt-nn", "mnist-cnn", "fashion-mlp"])
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps of every run")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--threads", type=int, default=1, help="ampx-train --threads")
    p.add_argument("--combos", type=int, default=len(COMBOS),
                   help="run only the first N combinations of COMBOS (the baseline first)")
    p.add_argument("--only", nargs="+", metavar="MASTERS-STATE", default=None,
                   help="run only these combinations of COMBOS, e.g. fp32-fp8 fp32-8bit")
    p.add_argument("--report-only", action="store_true",
                   help="write the tables from the stored runs, run nothing")
    p.add_argument("--out", default="runs/optim-convergence")
    args = p.parse_args()
    names = [f"{m}-{s}" for m, s in COMBOS]
    for name in args.only or []:
        if name not in names:
            p.error(f"--only {name}: not one of {' '.join(names)}")

    if not args.report_only:
        for workload in args.workloads:
            for masters, state in COMBOS[:args.combos]:
                if args.only and f"{masters}-{state}" not in args.only:
                    continue
                for seed in args.seeds:
                    run_one(args, workload, masters, state, seed)
    for workload in args.workloads:
        runs = [r for c in COMBOS for r in stored(args, workload, *c)]
        lines = table(args, workload)
        anchor = anchor_table(args, workload)
        if anchor:
            lines += [""] + anchor
        d = os.path.join(args.out, f"{workload}-{args.steps}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "convergence.json"), "w") as f:
            json.dump(runs, f, indent=1)
        with open(os.path.join(d, "convergence.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
