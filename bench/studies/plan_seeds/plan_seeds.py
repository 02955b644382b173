#!/usr/bin/env python3
"""Issue 44's B200 comparison over many seeds: the automatic plan against the
fixed rule (first and last blocks and the head in bf16, the rest NVFP4).

For each workload and seed, one `ampx-train --compare O2,auto,nvfp4` run
(measure, plan, prove, train the plan; then O2 and the rule from the same
seed), then a table of each mode's test loss against O2's and the paired
difference plan - rule, with its mean, spread and 95% confidence interval
over the seeds. Plain Python 3 (no torch): it runs the ampx-train binary.
Seeds go in turn over the workloads; a run whose folder already holds its
results is read again, not run, so an interrupted study continues, and
--summarize prints the tables of the runs done so far. AMPX_CPU_PRODUCTS is
pinned (native unless set): left to auto, each run times the bf16
products anew (ampx-train before ed6943f: each mode's process), and runs on
a loaded machine may take different paths.

  python3 bench/studies/plan_seeds/plan_seeds.py --binary build/host/apps/ampx-train/ampx-train \\
      --seeds 1337-1346 --workloads gpt,gpt-nn --out /tmp/plan-seeds

--widen-above G --widen-to F adds one run per seed: the seed's measured plan
with every NVFP4 layer whose measured weight-gradient error exceeds G moved
to format F, trained alone (--precision auto --precision-plan), and the
tables compare that variant (in place of the plan) with the rule and with
the plan. It asks whether the gradient error the probes measure picks the
layers whose format matters over a whole run. --widen-modules P1,P2 --widen-to
F makes the variant by position instead: the layers whose names start with
one of the prefixes (e.g. blocks.3.) move to F, whatever their format.
--tail T makes the variant in time: the seed's plan with its last T of the
steps in bf16 (the plan file's "tail", ampx-train's --plan-tail); with a
--widen option, both. It also trains the rule with the same tail
(--precision nvfp4 --fp8-tail T) and adds the table of the variant against
it, where both sides end, and are evaluated, in bf16. The study's own
runs measure with --plan-tail 0, the plan as the probes choose it, so that
the variants start from it; a variant's modelled time is averaged over the
run, its tail counted at bf16's. They measure with ampx-train's default
--plan-ends fp8 (the first and last blocks in 8-bit formats or wider);
--plan-ends none gives the plan as the probes alone choose it (use another
--out: a folder's runs are read again, not run).
"""

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys

# Two-sided 95% Student t quantiles by degrees of freedom (1..30), then 1.96.
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
       2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
       2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]

SHAPE = ["--layers", "4", "--d-model", "128", "--heads", "4", "--block-size", "64",
         "--batch-size", "16"]
# The cost models' products per second against bf16 (ampx::plan::cost_model_for).
SPEEDS = {
    "b200": {"fp32": 0.075 / 2.25, "fp16": 1.0, "bf16": 1.0, "fp8": 2.0, "fp8-block": 2.0,
             "mxfp8": 2.0, "nvfp4": 4.0},
    "h100": {"fp32": 67.0 / 989.0, "fp16": 1.0, "bf16": 1.0, "fp8": 1979.0 / 989.0,
             "fp8-block": 1979.0 / 989.0},
}
RULE = re.compile(r"first/last blocks and head bf16, rest nvfp4\s+[-+0-9.]+%\s+([0-9.]+)")


def seeds_of(text):
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",")]


def train(args, workload, seed, out, flags):
    """Runs ampx-train on the study's shape with `flags`, its output in
    `out`/run.log; stops the study if it fails."""
    os.makedirs(out, exist_ok=True)
    command = [args.binary, "--workload", workload, *SHAPE, "--steps", str(args.steps),
               "--seed", str(seed), *flags, "--out-dir", out]
    log_path = os.path.join(out, "run.log")
    with open(log_path, "w") as log:
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        sys.exit(f"plan_seeds: {' '.join(command)} failed ({code}); see {log_path}")


def run_one(args, workload, seed, run=True):
    out = os.path.join(args.out, f"{workload}-{seed}")
    log_path = os.path.join(out, "run.log")
    done = os.path.exists(os.path.join(out, "compare.json"))
    if not done and not run:
        return None
    if not done:
        train(args, workload, seed, out, ["--compare", "O2,auto,nvfp4", "--plan-tail", "0",
                                          "--plan-ends", args.plan_ends,
                                          "--loss-budget", args.budget, "--target", args.target])
    with open(os.path.join(out, "compare.json")) as f:
        modes = {m["mode"]: m for m in json.load(f)["modes"]}
    with open(os.path.join(out, "precision-plan.json")) as f:
        plan = json.load(f)
    with open(log_path) as f:
        rule = RULE.search(f.read())
    o2 = modes["O2"]["test_loss"]
    return {
        "workload": workload,
        "seed": seed,
        "plan_time": ((1 - plan.get("tail", 0.0)) * plan["cost"] / plan["bf16_cost"]
                      + plan.get("tail", 0.0)),
        "rule_time": float(rule.group(1)) if rule else float("nan"),
        "auto": 100 * (modes["auto"]["test_loss"] / o2 - 1),
        "rule": 100 * (modes["nvfp4"]["test_loss"] / o2 - 1),
        "o2_loss": o2,
    }


def variant_label(args):
    parts = []
    if args.widen_modules:
        parts.append(f"modules-{args.widen_modules.replace(',', '+')}-{args.widen_to}")
    elif args.widen_above is not None:
        parts.append(f"{args.widen_above}-{args.widen_to}")
    if args.tail is not None:
        parts.append(f"tail-{args.tail:g}")
    return "-".join(parts)


def widened(args, layer):
    """Whether the variant moves `layer` (a plan file's entry) to --widen-to."""
    if args.widen_modules:
        return any(layer["module"].startswith(p) for p in args.widen_modules.split(","))
    if args.widen_above is None:
        return False
    error = layer["grad_error"]
    return layer["format"] == "nvfp4" and error is not None and error > args.widen_above


def with_tail(plan, tail):
    """A plan file's content with its last `tail` of the steps in bf16 (version 3 or later)."""
    out = {}
    for key, value in plan.items():
        if key == "tail":
            continue
        out[key] = max(3, value) if key == "version" else value
        if key == "target" and "reference" not in plan:
            out["reference"] = "bf16"  # version 1 files have none: bf16
        if key == "bf16_cost":
            out["tail"] = tail
    return out


def run_time(plan, speed):
    """A plan file's modelled product time over a run against bf16's, its tail in bf16."""
    if plan.get("reference", "bf16") != "bf16":
        sys.exit("plan_seeds: the study models plans against a bf16 reference")
    shares = [l["flops_share"] for l in plan["layers"]]
    step = sum(l["flops_share"] / speed[l["format"]] for l in plan["layers"]) / sum(shares)
    tail = plan.get("tail", 0.0)
    return (1 - tail) * step + tail


def run_variant(args, workload, seed, row, run=True):
    """The --widen-above, --widen-modules or --tail variant of one seed's plan, trained alone."""
    base = os.path.join(args.out, f"{workload}-{seed}")
    out = os.path.join(base, f"widened-{variant_label(args)}")
    result = os.path.join(out, "compare.json")
    if not os.path.exists(result):
        if not run:
            return None
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(base, "precision-plan.json")) as f:
            plan = json.load(f)
        for layer in plan["layers"]:
            if widened(args, layer):
                layer["format"] = args.widen_to
                layer["scale_rule"] = f"{args.widen_to} (plan_seeds.py variant)"
        if args.tail is not None:
            plan = with_tail(plan, args.tail)
        plan_path = os.path.join(out, "variant-plan.json")
        with open(plan_path, "w") as f:
            json.dump(plan, f, indent=2)
        train(args, workload, seed, out, ["--precision", "auto", "--precision-plan", plan_path])
    with open(os.path.join(out, "variant-plan.json")) as f:
        plan = json.load(f)
    if args.target not in SPEEDS:
        sys.exit(f"plan_seeds: a variant is modelled on {', '.join(SPEEDS)}, "
                 f"not --target {args.target}")
    time = run_time(plan, SPEEDS[args.target])
    with open(result) as f:
        loss = json.load(f)["modes"][0]["test_loss"]
    o2 = row["o2_loss"]
    return {**row, "plan_time": time, "plan": row["auto"], "auto": 100 * (loss / o2 - 1)}


def run_rule_tail(args, workload, seed, row, run=True):
    """The fixed rule with the same tail as the --tail variant: --precision nvfp4
    --fp8-tail T, so that both end in one format."""
    out = os.path.join(args.out, f"{workload}-{seed}", f"rule-tail-{args.tail:g}")
    result = os.path.join(out, "compare.json")
    if not os.path.exists(result):
        if not run:
            return None
        train(args, workload, seed, out, ["--precision", "nvfp4", "--fp8-tail", str(args.tail)])
    with open(result) as f:
        loss = json.load(f)["modes"][0]["test_loss"]
    return {**row, "rule+tail": 100 * (loss / row["o2_loss"] - 1),
            "rule_tail_time": (1 - args.tail) * row["rule_time"] + args.tail}


def summary(label, rows, other="rule"):
    d = [r["auto"] - r[other] for r in rows]
    n = len(d)
    mean = statistics.mean(d)
    sd = statistics.stdev(d) if n > 1 else float("nan")
    half = (T95[n - 2] if n - 1 <= len(T95) else 1.96) * sd / math.sqrt(n) if n > 1 else math.nan
    no_worse = sum(1 for x in d if x <= 0.005)  # equal to the table's 0.01 points
    return (f"| {label} | {n} | {statistics.mean(r['auto'] for r in rows):+.3f}% | "
            f"{statistics.mean(r[other] for r in rows):+.3f}% | {mean:+.3f} | {sd:.3f} | "
            f"[{mean - half:+.3f}, {mean + half:+.3f}] | {no_worse} of {n} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--binary", help="the ampx-train binary (not needed with --summarize)")
    p.add_argument("--summarize", action="store_true", help="only the runs already done")
    p.add_argument("--seeds", default="1337-1346", help="first-last, or a comma list")
    p.add_argument("--workloads", default="gpt,gpt-nn")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--budget", default="0.5%")
    p.add_argument("--target", default="b200")
    p.add_argument("--plan-ends", default="fp8", help="ampx-train's --plan-ends for the measured "
                   "plans (none: no floor at the first and last blocks)")
    p.add_argument("--out", required=True, help="a folder for the runs and results.json")
    p.add_argument("--widen-above", type=float, help="a variant: NVFP4 layers whose measured "
                   "gradient error exceeds this move to --widen-to")
    p.add_argument("--widen-modules", help="a variant: layers whose names start with one of "
                   "these comma-separated prefixes move to --widen-to")
    p.add_argument("--widen-to", default="bf16", choices=["bf16", "fp8", "fp8-block", "mxfp8"])
    p.add_argument("--tail", type=float, help="a variant: the plan with its last TAIL of the "
                   "steps (a share in (0, 1)) in bf16; with a --widen option, both")
    args = p.parse_args()
    if args.tail is not None and not 0 < args.tail < 1:
        p.error(f"--tail {args.tail} is not a share of the steps in (0, 1)")
    variant = args.widen_above is not None or bool(args.widen_modules) or args.tail is not None
    if args.widen_above is not None and args.widen_modules:
        p.error("--widen-above and --widen-modules make different variants: pass one")
    if not args.summarize and not args.binary:
        p.error("--binary is needed to run")
    os.environ.setdefault("AMPX_CPU_PRODUCTS", "native")
    rows = []
    for seed in seeds_of(args.seeds):
        for workload in args.workloads.split(","):
            r = run_one(args, workload, seed, run=not args.summarize)
            if r is not None and variant:
                r = run_variant(args, workload, seed, r, run=not args.summarize)
            if r is not None and args.tail is not None:  # (a study without them keeps its rows)
                r = run_rule_tail(args, workload, seed, r, run=not args.summarize) or r
            if r is None:
                continue
            rows.append(r)
            extra = f" (the plan {r['plan']:+.3f}%)" if "plan" in r else ""
            if "rule+tail" in r:
                extra += (f" (the rule with the tail {r['rule+tail']:+.3f}%, modelled "
                          f"{r['rule_tail_time']:.3f})")
            print(f"{workload} {seed}: auto {r['auto']:+.3f}% rule {r['rule']:+.3f}%{extra} "
                  f"(modelled {r['plan_time']:.3f} vs {r['rule_time']:.3f})", flush=True)
    if variant:
        moved = []
        if args.widen_modules:
            moved.append(f"layers {args.widen_modules}* in {args.widen_to}")
        elif args.widen_above is not None:
            moved.append(f"NVFP4 layers with gradient error above {args.widen_above} in "
                         f"{args.widen_to}")
        if args.tail is not None:
            moved.append(f"the last {100 * args.tail:g}% of the steps in bf16")
        print(f"\n'auto' below is the variant: {', '.join(moved)}; 'plan' is the measured plan")
    if not rows:
        sys.exit(f"plan_seeds: no runs done in {args.out} yet")
    name = f"results-widened-{variant_label(args)}.json" if variant else "results.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n| workload | seed | plan's modelled time | rule's | auto vs O2 | rule vs O2 | "
          "auto - rule |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['workload']} | {r['seed']} | {r['plan_time']:.3f} | {r['rule_time']:.3f} | "
              f"{r['auto']:+.2f}% | {r['rule']:+.2f}% | {r['auto'] - r['rule']:+.2f} |")
    # auto (or the variant) against the rule, and the variant against the plan.
    # With --tail, the variant against the rule given the same tail too: one final format.
    others = [("auto", "rule")] + ([("variant", "plan")] if variant else [])
    others += [("variant", "rule+tail")] if args.tail is not None else []
    for name, other in others:
        rows_with = [r for r in rows if other in r]
        if not rows_with:
            continue
        print(f"\n| runs | n | mean {name} | mean {other} | mean {name} - {other} (points) | sd | "
              f"95% CI | {name} <= {other} |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
        for workload in args.workloads.split(","):
            mine = [r for r in rows_with if r["workload"] == workload]
            if mine:
                print(summary(workload, mine, other))
        print(summary("all", rows_with, other))


if __name__ == "__main__":
    main()
