#!/usr/bin/env python3
"""Runs every ampx benchmark in one go and writes the run of record of this kind of CPU.

  make bench                        # bench/run_all.py --build build/host --wheel-build ... (Makefile)
  bench/run_all.py --quick          # small sizes and few steps: checks the harness, not the machine

In one run, on one machine, with the same threads everywhere:
  1. matrix-product peaks (ampx_gemm_peak, on each LibTorch): fp32 and bf16 GFLOP/s, MFU's
     denominators;
  2. micro-benchmarks (Google Benchmark programs, --benchmark_out JSON): non-finite check +
     unscale, scale update, fused AdamW / SGD against torch::optim's, casts, each next to a copy;
  3. end to end against PyTorch's wheel, the main anchor (wheel.py; --wheel-build, --wheel-python):
     ampx-train built against the wheel's LibTorch in every mode (fp32, O1, O2, O3: pure bf16
     with stochastic rounding) and the wheel's Python on the same models (bench/python), eager
     and torch.compile'd, fp32 and torch.autocast bf16, torch's default AdamW and
     AdamW(fused=True) (--wheel-adamw); ampx-train on LibTorch 2.14 (the forky chroot,
     --forky-train) beside them when built; on the GPTs, ampx-train fp32 and O2 with each
     --recompute setting (activation checkpointing: O2's peak and its cost);
  4. end to end against Debian's 1.13, the second anchor: ampx-train built against it, and
     Debian's python3-torch with torch.autocast and torch.optim.AdamW (its for-loop: 1.13 has
     no fused CPU AdamW), fp32 and bf16;
     parts 3 and 4 interleaved, round after round; median step, throughput, peak allocated
     memory, MFU;
  5. what each side ran (kernel_probe.py): a one-step bf16 run of each with oneDNN's verbose
     mode: oneDNN's ISA and bf16 kernels, the fp32 BLAS, the attention path;
  6. data parallel (ampx_dist_bench): Gloo collectives, gpt with 1 and 2 processes; and
     bytes per parameter on each rank under --shard none/optimizer/grad/full at 1, 2 and 4
     ranks (sharding.py);
  7. numerics diagnostics (ampx::debug): ampx-train gpt fp32 plain, with --detect-nonfinite
     (NonFiniteGuard) and with --range-stats (RangeStatsCollector), step time and ratio to plain;
     with --baseline-train, also the plain step of another build (nothing active vs before);
  8. causal attention by shape (ampx_attention_bench): ampx's fused kernel against the explicit
     ops on this LibTorch, and on 2.14 (--forky-build, the forky chroot) against LibTorch's own
     at::scaled_dot_product_attention too;
  9. FP8 against torchao (fp8.py; --wheel-build, --wheel-python): ampx_fp8_bench and torchao's
     Float8Linear on a GPT-2-small block's shapes, both emulated on the CPU.
Then the targets, each as a ratio measured in this run, met or not: the wheel's (issues 39
and 67: against Python's best variant per precision) first. The report is the run of record
of the CPU's kind (AMX, AVX512-BF16, AVX2, ...: from /proc/cpuinfo, or --cpu-kind):
docs/performance/cpu-KIND.md (machine, targets, end to end), cpu-KIND-parts.md (parts 2 and
6 to 9), cpu-KIND.json, and the kind's row of the index, docs/PERFORMANCE.md; the other
kinds' runs stay (record.py).

Only the standard library: the orchestration (this file and bench/'s harness.py, e2e.py,
wheel.py, kernel_probe.py, step_profile.py, attention.py, fp8.py, record.py) runs under any
python3.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import attention  # noqa: E402 - bench/'s modules, beside this file
import e2e  # noqa: E402
import fp8  # noqa: E402
import harness  # noqa: E402
import kernel_probe  # noqa: E402
import record  # noqa: E402
import sharding  # noqa: E402
import step_profile  # noqa: E402
import wheel  # noqa: E402
from e2e import GPT_WORKLOADS, MODES, WORKLOADS, gpt_flops_per_step  # noqa: E402
from harness import (FOREIGN, MAX_FOREIGN_CORES, ROOT, combine_e2e, combine_python, fmt,  # noqa: E402
                     log, run, target_row)

TORCH_PYTHON = "/usr/bin/python3"  # Debian's python3-torch
# (name in the results, program, its flags): the optimizer benchmark is one
# program run once per optimizer, under the names its runs had when they were
# separate programs (ampx_optim_bench was AdamW's).
MICRO = [("ampx_bench", "ampx_bench", []),
         ("ampx_optim_bench", "ampx_optim_bench", ["--optimizer=adamw"]),
         ("ampx_sgd_bench", "ampx_optim_bench", ["--optimizer=sgd"]),
         ("ampx_lamb_bench", "ampx_optim_bench", ["--optimizer=lamb"]),
         ("ampx_cast_bench", "ampx_cast_bench", []),
         ("ampx_fused_bench", "ampx_fused_bench", []),
         ("ampx_scale_update_bench", "ampx_scale_update_bench", [])]


def git_commit():
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


# --------------------------------------------------------------------- parts
def gemm_peaks(args, out):
    path = os.path.join(out, "gemm.json")
    cmd = [os.path.join(args.build, "bench", "ampx_gemm_peak"), "--threads", str(args.threads),
           "--json", path]
    if args.quick:
        cmd += ["--sizes", "256,512", "--reps", "3"]
    run(cmd)
    with open(path) as f:
        return json.load(f)


def micro(args, out):
    results = {}
    for prog, program, flags in MICRO:
        exe = os.path.join(args.build, "bench", program)
        if not os.path.exists(exe):
            log(f"{program} not built, skipped")
            continue
        path = os.path.join(out, prog + ".json")
        cmd = [exe] + flags + [f"--benchmark_out={path}", "--benchmark_out_format=json"]
        if args.quick:
            cmd += ["--elements=1000000", "--benchmark_min_time=0.01"]
        text = run(cmd)
        with open(os.path.join(out, prog + ".txt"), "w") as f:
            f.write(text)
        with open(path) as f:
            results[prog] = {"benchmarks": json.load(f)["benchmarks"], "summary": text,
                             "command": " ".join([program] + flags)}
    return results


def dist(args, out):
    exe = os.path.join(args.build, "bench", "ampx_dist_bench")
    if not os.path.exists(exe):
        log("ampx_dist_bench not built (no c10d/Gloo), skipped")
        return None
    path = os.path.join(out, "dist.json")
    text = run([exe, "--steps", "3" if args.quick else "10", "--bucket-mib", "4", "--json", path])
    with open(path) as f:
        result = json.load(f)
    result["summary"] = text
    return result


# (name in the results, ampx-train's extra flags): the diagnostics' cost on one
# fp32 gpt run each (docs/numerics.md)
DEBUG_RUNS = [("plain", []), ("detect-nonfinite", ["--detect-nonfinite"]),
              ("range-stats", ["--range-stats"])]


def debug_run(args, out, workload, name, flags, rnd=0, exe=None):
    d = os.path.join(out, "debug", f"{workload}-{name}" + (f"-r{rnd}" if rnd else ""))
    shutil.rmtree(d, ignore_errors=True)
    cmd = [exe or os.path.join(args.build, "apps", "ampx-train", "ampx-train"), "--workload",
           workload, "--precision", "fp32", "--steps", str(args.debug_steps), "--threads",
           str(args.threads), "--out-dir", d, "--progress", "none", "--eval-batches", "1"] + flags
    if args.debug_batch_size and workload == "gpt":
        cmd += ["--batch-size", str(args.debug_batch_size)]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    run(cmd)
    with open(os.path.join(d, "compare.json")) as f:
        return json.load(f)["modes"][0]


def debug_cost(args, out, workload):
    """Each diagnostic's median step (the median of its rounds' medians), runs interleaved. A
    diagnostic that fails is reported as failed (with its message), not fatal."""
    runs = list(DEBUG_RUNS) + ([("baseline", [])] if args.baseline_train else [])
    rounds, failed = {name: [] for name, _ in runs}, {}
    for rnd in range(args.rounds):
        for name, flags in runs:
            if name in failed:
                continue
            exe = args.baseline_train if name == "baseline" else None
            try:
                rounds[name].append(
                    debug_run(args, out, workload, name, flags, rnd, exe)["median_step_ms"])
            except SystemExit as e:
                if name == "plain":
                    raise
                failed[name] = str(e)
    result = {"workload": workload, "steps": args.debug_steps, "threads": args.threads,
              "batch_size": args.debug_batch_size if args.debug_batch_size and
              workload == "gpt" else None,
              "runs": {name: {"median_step_ms": statistics.median(ms), "round_ms": ms}
                       for name, ms in rounds.items() if name not in failed},
              "failed": failed}
    if args.baseline_train:
        result["baseline_train"] = args.baseline_train
    plain = result["runs"]["plain"]["median_step_ms"]
    for r in result["runs"].values():
        r["vs_plain"] = r["median_step_ms"] / plain
    return result


# --------------------------------------------------------------------- report
def bench_by_name(micro_results, prog):
    return {b["name"]: b for b in micro_results.get(prog, {}).get("benchmarks", [])
            if b.get("run_type", "iteration") == "iteration"}


def worst_ratio(benchmarks, numerator, denominator, key):
    """min over thread counts of numerator/denominator of `key`, names 'BM_X/threads'."""
    best = None
    for name, b in benchmarks.items():
        if not name.startswith(numerator + "/"):
            continue
        other = benchmarks.get(denominator + name[len(numerator):])
        if other and other.get(key) and b.get(key):
            r = b[key] / other[key]
            best = r if best is None else min(best, r)
    return best


def build_report(args, data, files):
    """The run's two pages, as lists of lines: (cpu-KIND.md, cpu-KIND-parts.md) (record.py)."""
    gemm, e2e_r, py = data["gemm"], data["e2e"], data["python"]
    peaks = {"fp32": gemm.get("fp32_peak_gflops"), "bf16": gemm.get("bf16_peak_gflops")}
    wh = data.get("wheel")
    m = data["machine"]
    kind = m["kind"]
    lines = []
    w = lines.append
    w(f"# ampx performance on `{kind['kind']}` ({kind['label']})")
    w("")
    w("Generated by `make bench` (`bench/run_all.py`): the run of record on this kind of CPU "
      f"([the index](../PERFORMANCE.md)); every number below comes from the one run of "
      f"{data['date']}. The machine is shared and noisy, so compare ratios within this run, "
      f"not absolute numbers across runs. The rest of the run: [{os.path.basename(files['parts'])}]"
      f"({os.path.basename(files['parts'])}); machine-readable: `{record.shown(files['json'])}`.")
    w("")
    w(f"- CPU kind: `{kind['kind']}` ({kind['label']}); `/proc/cpuinfo` lists "
      f"{', '.join(kind['isa']) or 'none of AVX2, AVX-512, AVX512-BF16, AVX512-FP16, AMX-BF16'}"
      + (" (named by `--cpu-kind`)." if kind.get("named") else "."))
    w(f"- Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads used everywhere.")
    if wh:
        w(f"- Main anchor: PyTorch's wheel, torch {wh['torch_version']} (`{wh['python']}`), and "
          f"ampx built against its LibTorch (`{wh['build']}`).")
    w(f"- Second anchor: Debian's LibTorch {m['libtorch']} (fp32 BLAS: {m['blas']}) under ampx "
      f"(`{args.build}`) and Debian's Python torch (`{TORCH_PYTHON}`).")
    w(f"- Code: commit {data['commit']}.")
    fl = data.get("foreign_load", [])
    worst = max(fl, key=lambda x: x[1]) if fl else None
    if worst:
        w(f"- Other load on the machine, measured around every program (system busy time not "
          f"spent by the benchmark): at most {worst[1]:.2f} cores ({worst[0]}); "
          + (f"a program is run again, up to {harness.RETRIES} times, when it exceeds "
             f"{MAX_FOREIGN_CORES} cores." if harness.RETRIES else "no program was rerun (quick "
                                                                     "mode).")
          + (" **Some timings were taken under load; treat them with care.**"
             if worst[1] > MAX_FOREIGN_CORES else ""))
    w(f"- Command: `{data['command']}`"
      + (" (quick mode: small sizes, for checking the harness only)" if args.quick else ""))
    w(f"- Matrix-product peaks measured in this run on Debian's 1.13: fp32 {fmt(peaks['fp32'])} "
      f"GFLOP/s, bf16 {fmt(peaks['bf16'])} GFLOP/s (`ampx_gemm_peak`, best of square sizes)"
      + (f": a model bound by its matrix products can run at most "
         f"{peaks['bf16'] / peaks['fp32']:.2f}x faster in bf16 than in fp32 there."
         if peaks['fp32'] and peaks['bf16'] else "."))
    if wh and wh.get("gemm"):
        wp = wh["gemm"]
        w(f"- The same on the wheel's LibTorch: fp32 {fmt(wp.get('fp32_peak_gflops'))} GFLOP/s, "
          f"bf16 {fmt(wp.get('bf16_peak_gflops'))} GFLOP/s.")
    if data.get("rounds", 1) > 1:
        w(f"- End to end: {data['rounds']} rounds, ampx and PyTorch interleaved (every "
          "configuration once per round); a run's step time is the median of its rounds' median "
          "steps, and the `rounds` column gives the fastest and slowest round.")
    w("- Throughput is items per step over the median step (tokens for gpt, images "
      "otherwise), for ampx and PyTorch alike.")
    w("")

    # targets first: the wheel's, then the rest
    w("## Targets")
    w("")
    groups = []
    for t in data["targets"]:
        if t["group"] not in groups:
            groups.append(t["group"])
    for g in groups:
        w(f"### {g}")
        w("")
        w("| what | target | measured | | note |")
        w("| --- | --- | --- | --- | --- |")
        for t in data["targets"]:
            if t["group"] == g:
                w(f"| {t['what']} | {t['target']} | {t['measured']} | {status(t)} | {t['note']} |")
        w("")

    lines += wheel.report(data)
    if e2e_r:
        w(f"## Against Debian's Python torch {m['libtorch']}")
        w("")
        w(f"ampx-train built against Debian's LibTorch (`{args.build}`) next to Debian's own "
          f"Python torch on the same models and data, fp32 and `torch.autocast` bf16 (eager: "
          "no `torch.compile` before 2.0; AdamW's for-loop: no fused CPU AdamW before 2.4).")
        w("")
    for workload in WORKLOADS:
        if workload not in e2e_r:
            continue
        c = e2e_r[workload]
        rows = e2e.ampx_rows(c)
        for prec in ("fp32", "autocast-bf16"):
            if py.get(workload, {}).get(prec):
                rows.append(e2e.python_row(f"PyTorch {prec}", py[workload][prec]))
        w(f"### {workload} (Debian {m['libtorch']})")
        w("")
        lines += e2e.workload_table(workload, c["settings"], rows, peaks)
    lines += kernel_probe.report(data.get("what_ran") or [], compiled_attention(wh))
    lines += step_profile.report((wh or {}).get("profiles"))
    w("## Notes")
    w("")
    w("The analysis behind these numbers (where the time goes, what is outside ampx) is in "
      "[performance-notes.md](../performance-notes.md).")
    return lines, parts_report(data, files)


def parts_report(data, files):
    """cpu-KIND-parts.md: the parts of the run beside end to end, those that ran."""
    micro_r, dist_r = data["micro"], data["dist"]
    kind = data["machine"]["kind"]["kind"]
    lines = []
    w = lines.append
    w(f"# ampx's parts on `{kind}`: FP8, micro-benchmarks, data parallel, diagnostics, sharding, "
      "attention")
    w("")
    w(f"Generated by `make bench` (`bench/run_all.py`) in the run of {data['date']} (commit "
      f"{data['commit']}), the run of record on this kind of CPU: its machine, command and "
      f"targets are in [{os.path.basename(files['main'])}]({os.path.basename(files['main'])}).")
    w("")
    start = len(lines)
    lines += fp8.report(data.get("fp8"))
    if micro_r:
        w("## Micro-benchmarks")
        w("")
        w("Each program's closing table, as it printed it (bytes credited per element are "
          "documented at the top of each source in `bench/`).")
        w("")
        for prog, r in micro_r.items():
            w(f"### `{r.get('command', prog)}`")
            w("")
            w("```")
            summary = r["summary"].strip().splitlines()
            # Google Benchmark's own rows are in the JSON; keep the program's
            # first line (what is measured) and its closing ratio table.
            own = lambda l: "real_time" in l or l.startswith(("---", "Benchmark"))
            w("\n".join(l for l in summary if l.strip() and not own(l)))
            w("```")
            w("")

    if dist_r:
        w("## Data parallel (`ampx_dist_bench`, 2 processes on loopback, Gloo)")
        w("")
        w("```")
        w(dist_r["summary"].strip())
        w("```")
        w("")
    for dbg in (data.get("debug") or {}).values():
        batch = f" --batch-size {dbg['batch_size']}" if dbg.get("batch_size") else ""
        w(f"## Numerics diagnostics (`ampx::debug`, {dbg['workload']} fp32)")
        w("")
        w(f"`ampx-train --workload {dbg['workload']} --precision fp32 --steps {dbg['steps']}{batch} "
          f"--threads {dbg['threads']}`, plain and with each diagnostic (docs/numerics.md); median "
          "step after warm-up. `plain` has every model scope open (`ModuleScopeGuard`) and nothing "
          "alive: what a user pays when the diagnostics are off."
          + (f" `baseline` is `{dbg['baseline_train']}` (another build)."
             if dbg.get("baseline_train") else ""))
        w("")
        w("| run | median step ms | rounds ms | vs plain |")
        w("| --- | ---: | ---: | ---: |")
        for name, r in dbg["runs"].items():
            rounds = (f"{min(r['round_ms']):.1f}–{max(r['round_ms']):.1f}"
                      if len(r["round_ms"]) > 1 else "-")
            w(f"| {name} | {fmt(r['median_step_ms'])} | {rounds} | {r['vs_plain']:.2f}x |")
        for name, why in dbg.get("failed", {}).items():
            w(f"| {name} | failed: {why} | | |")
        w("")
    lines += sharding.report(data.get("sharding"))
    lines += attention.report(data.get("attention") or [])
    if len(lines) == start:
        w(f"None of these parts ran in this run (parts: {', '.join(data['parts'])}).")
    return lines


def status(target, plain=False):
    """'met', 'missed' (bold in the report) or, where nothing was measured, 'not measured'."""
    if target["value"] is None:
        return "not measured"
    if target["met"]:
        return "met"
    return "MISSED" if plain else "**missed**"


def compiled_attention(wh):
    """{workload: attention kernel} of the wheel's compiled autocast runs, or None."""
    if not wh:
        return None
    return {w: r["compiled autocast-bf16"].get("attention_kernel")
            for w, r in wh["python_runs"].items()
            if w in GPT_WORKLOADS and r.get("compiled autocast-bf16")} or None


# The targets' groups in the report, after the wheel's (wheel.GROUP).
DEBIAN_GROUP = "Debian's LibTorch 1.13 (the earlier issues' anchor)"
OWN_GROUP = "ampx's kernels and diagnostics"


def targets(data):
    """Every target measured in this run: the wheel's (issues 39 and 67) first."""
    out = wheel.targets(data) if "wheel" in data["parts"] else []
    peaks = {"fp32": data["gemm"].get("fp32_peak_gflops"),
             "bf16": data["gemm"].get("bf16_peak_gflops")}

    def add(*a, group=DEBIAN_GROUP, **kw):
        out.append(target_row(*a, group=group, **kw))

    e2e = data["e2e"]
    step = lambda w, m: next((x["median_step_ms"] for x in e2e.get(w, {}).get("modes", [])
                              if x["mode"] == m), None)
    py_step = lambda w, p: data["python"].get(w, {}).get(p, {}).get("median_step_ms")
    # Same model, same data, same LibTorch: ampx-train against bench/python (issue 16).
    for w in WORKLOADS:
        # fp32 on the GPTs: 1.1x (the same BLAS on both sides; issue 29).
        want_fp32 = 1.1 if w in GPT_WORKLOADS else 1.0
        for mode, prec, what, want in (
                ("fp32", "fp32", "fp32 vs Python fp32", want_fp32),
                ("O1", "autocast-bf16", "O1 vs Python torch.autocast bf16", 1.0)):
            mine, theirs = step(w, mode), py_step(w, prec)
            if mine is not None or theirs is not None:
                add(f"{w}, ampx {what} (step time)", f">= {want:g}x",
                    theirs / mine if mine and theirs else None, want)
    if "gpt" in e2e:
        f32 = step("gpt", "fp32")
        best = min(step("gpt", "O1"), step("gpt", "O2"))
        bound = (f"the bf16 / fp32 GEMM peak ratio measured in this run is "
                 f"{peaks['bf16'] / peaks['fp32']:.2f}x" if peaks["bf16"] and peaks["fp32"] else "")
        add("gpt, O1 or O2 bf16 vs fp32 step time", ">= 3x", f32 / best, 3.0, note=bound)
        best_mixed = min(step("gpt", m) for m in MODES if m != "fp32")
        pyb = py_step("gpt", "autocast-bf16")
        # Which attention each side ran: LibTorch's fused SDPA kernels differ
        # by version and dtype, so a comparison names them.
        attention = (f"attention: ampx {e2e['gpt']['settings'].get('attention')}; Python "
                     f"{data['python'].get('gpt', {}).get('autocast-bf16', {}).get('attention')}")
        add("gpt, ampx best mixed mode vs Python torch.autocast bf16", ">= 1.3x",
            pyb / best_mixed if pyb else None, 1.3, note=attention)
        flops = gpt_flops_per_step(e2e["gpt"]["settings"]["batch_size"])
        mfu = flops / (best_mixed / 1e3) / (peaks["bf16"] * 1e9) if peaks["bf16"] else None
        add("gpt MFU against the measured bf16 GEMM peak", ">= 70%", mfu, 0.70, unit="%")
        peak = {x["mode"]: x["peak_allocated_bytes"] for x in e2e["gpt"]["modes"]}
        add("gpt O2 peak memory vs fp32", "<= 0.55x", peak["O2"] / peak["fp32"], 0.55,
            higher_is_better=False)
        # Issue 43: trying a block-scaled format on a laptop is practical.
        if step("gpt", "mxfp8") is not None:
            add("gpt mxfp8 step (TE's recipe, emulated) vs O2 step", "<= 2x",
                step("gpt", "mxfp8") / step("gpt", "O2"), 2.0, higher_is_better=False,
                note=f"nvfp4 {step('gpt', 'nvfp4') / step('gpt', 'O2'):.2f}x, fp8-block "
                     f"{step('gpt', 'fp8-block') / step('gpt', 'O2'):.2f}x")
    if "gpt-nn" in e2e:
        best_mixed = min(step("gpt-nn", m) for m in MODES if m != "fp32")
        pyb = py_step("gpt-nn", "autocast-bf16")
        add("gpt-nn (torch.nn's modules), ampx best mixed mode vs Python torch.autocast bf16",
            ">= 1.3x", pyb / best_mixed if pyb else None, 1.3,
            note=f"attention: {e2e['gpt-nn']['settings'].get('attention')} on both sides")
    if "mnist-cnn" in e2e:
        add("mnist-cnn, O2 vs O1 step time", ">= 1.0x",
            step("mnist-cnn", "O1") / step("mnist-cnn", "O2"), 1.0)
    for w, want in (("mnist-cnn", 1.3), ("fashion-mlp", 2.0)):
        if w not in e2e:
            continue
        best_any = min(step(w, m) for m in MODES)
        pys = [x for x in (py_step(w, "fp32"), py_step(w, "autocast-bf16")) if x]
        add(f"{w}, ampx best mode vs Python's best (fp32 or autocast)", f">= {want:g}x",
            min(pys) / best_any if pys else None, want)
    for w, dbg in (data.get("debug") or {}).items():
        runs = dbg["runs"]
        add(f"{w} fp32 step with range statistics (--range-stats) vs plain", "<= 2x",
            runs["range-stats"]["vs_plain"] if "range-stats" in runs else None, 2.0,
            higher_is_better=False, note=dbg["failed"].get("range-stats", ""), group=OWN_GROUP)
        if "baseline" in runs:
            add(f"{w} fp32 step, diagnostics off, vs the baseline build", "<= 1.02x",
                1 / runs["baseline"]["vs_plain"], 1.02, higher_is_better=False,
                note=dbg["baseline_train"], group=OWN_GROUP)
    optim = bench_by_name(data["micro"], "ampx_optim_bench")
    adamw = worst_ratio(optim, "BM_AdamWTorchFp32", "BM_AdamWAmpxBf16", "real_time") if optim else None
    add("fused AdamW vs torch::optim::AdamW (step time)", ">= 3x", adamw, 3.0,
        note="the lower of 1 and 2 threads", group=OWN_GROUP)
    unscale = bench_by_name(data["micro"], "ampx_bench")
    ratio = None
    if unscale:
        ratio = worst_ratio(unscale, "BM_UnscaleAmpx_avx512", "BM_Copy", "bytes_per_second") or \
            worst_ratio(unscale, "BM_UnscaleAmpx_avx2", "BM_Copy", "bytes_per_second")
    add("unscale + inf check vs copy bandwidth", ">= 0.7x", ratio, 0.7,
        note="the lower of 1 and 2 threads", group=OWN_GROUP)
    return out


def machine(args, gemm, e2e):
    cpu = gemm.get("cpu") or platform.processor()
    any_e2e = next(iter(e2e.values()), {})
    kind = record.cpu_kind(override=args.cpu_kind)
    kind["named"] = bool(args.cpu_kind)
    return {"cpu": cpu, "kind": kind, "cores": os.cpu_count(), "threads": args.threads,
            "libtorch": gemm.get("torch_version") or any_e2e.get("machine", {}).get("libtorch"),
            "blas": gemm.get("blas") or any_e2e.get("machine", {}).get("blas"),
            "python": platform.python_version()}


def end_to_end(args, parts, data):
    """The end-to-end parts into data: Debian's ampx and Python ('e2e', 'python') and the
    wheel's side ('wheel'), every configuration once per round, rounds in turn (the machine's
    speed drifts over minutes, and each configuration samples it alike); then what each side
    ran ('kernels': short probes, untimed)."""
    on_wheel = "wheel" in parts and wheel.enabled(args)
    host_train = os.path.join(args.build, "apps", "ampx-train", "ampx-train")
    if on_wheel:
        data["wheel_gemm"] = wheel.gemm_peaks(args, args.out, args.quick) if "gemm" in parts else {}
        wheel_rounds = wheel.start(args, args.out)
        forky_exe = wheel.forky_train(args)
    e2e_rounds = {w: [] for w in WORKLOADS}
    py_rounds = {w: {"fp32": [], "autocast-bf16": []} for w in WORKLOADS}
    for rnd in range(args.rounds):
        for w in args.workloads:
            if "e2e" in parts:
                e2e_rounds[w].append(e2e.ampx_train(host_train, args, args.out, w, rnd,
                                                    block=w == "gpt"))
            if "python" in parts:
                for prec in py_rounds[w]:
                    py_rounds[w][prec].append(
                        e2e.python_amp(TORCH_PYTHON, args, args.out, w, prec, rnd))
            if on_wheel:
                wheel.run_round(args, args.out, w, rnd, wheel_rounds, forky_exe)
    for w in args.workloads:
        if e2e_rounds[w]:
            data["e2e"][w] = combine_e2e(e2e_rounds[w])
        if "python" in parts:
            data["python"][w] = {prec: combine_python(r) for prec, r in py_rounds[w].items()}
    if on_wheel:
        data["wheel"] = wheel.combine(args, args.out, wheel_rounds, data.pop("wheel_gemm"))
    if "kernels" in parts:
        sides = []
        if wheel.enabled(args):
            sides += [{"name": "ampx on the wheel", "kind": "ampx", "tag": "wheel",
                       "exe": wheel.ampx_train_of(args.wheel_build)},
                      {"name": "PyTorch's wheel, eager", "kind": "python", "tag": "wheel",
                       "python": args.wheel_python}]
        sides += [{"name": "ampx on Debian's 1.13", "kind": "ampx", "tag": "host",
                   "exe": host_train},
                  {"name": "Debian's Python 1.13", "kind": "python", "tag": "host",
                   "python": TORCH_PYTHON}]
        data["what_ran"] = kernel_probe.what_ran(args, args.out, sides)


def write_docs(args, data):
    """The run's pages and JSON under its CPU kind, and its row of the index (record.py)."""
    files = record.record_files(args.doc, data["machine"]["kind"]["kind"], args.json)
    main_lines, parts_lines = build_report(args, data, files)
    json_text = json.dumps({k: v for k, v in data.items() if k != "micro"} |
                           {"micro": {k: v["benchmarks"] for k, v in data["micro"].items()}},
                           indent=1) + "\n"
    record.write_record(files, data, main_lines, parts_lines, json_text)
    log(f"wrote {files['main']}, {files['parts']}, {files['json']} and {files['index']}'s row")
    return files


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build", "host"))
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench"),
                   help="raw outputs of every program")
    p.add_argument("--doc", default=os.path.join(ROOT, "docs", "PERFORMANCE.md"),
                   help="the index of the runs of record; the run's pages go into the "
                        "performance/ folder beside it, one pair per CPU kind (record.py)")
    p.add_argument("--json", default=None,
                   help="every number of the run [default: performance/cpu-KIND.json beside the "
                        "run's pages]")
    p.add_argument("--cpu-kind", default=None,
                   help="the CPU's kind, whose run of record this run replaces [default: from "
                        "/proc/cpuinfo's flags: " + ", ".join(k for k, _, _ in record.KINDS) + "]")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--gpt-steps", type=int, default=None, help="[default: 40; --quick 8]")
    p.add_argument("--image-steps", type=int, default=None, help="[default: 100; --quick 12]")
    p.add_argument("--gpt-batch", type=int, default=None,
                   help="the GPTs' batch on every side [default: the programs' own, 32; --quick 4]")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma-separated end-to-end workloads [default: all]")
    p.add_argument("--rounds", type=int, default=None,
                   help="end-to-end runs (ampx and PyTorch interleaved) per configuration; "
                        "the report takes the median [default: 3; --quick 1]")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--debug-steps", type=int, default=None,
                   help="steps of each numerics-diagnostics run (part 'debug') [default: 20; "
                        "--quick 6]")
    p.add_argument("--debug-batch-size", type=int, default=0,
                   help="gpt's batch in the numerics-diagnostics runs [default: gpt's, 32]")
    p.add_argument("--debug-workloads", default="gpt",
                   help="comma-separated workloads the numerics-diagnostics part runs")
    p.add_argument("--baseline-train", default=None,
                   help="another build's ampx-train: part 'debug' also times its plain gpt "
                        "fp32 step (diagnostics off here vs that build)")
    p.add_argument("--forky-build", default=os.path.join(ROOT, "build", "forky-bench"),
                   help="the forky chroot's build of ampx_attention_bench (LibTorch 2.14)")
    p.add_argument("--wheel-build", default=None,
                   help="ampx built against PyTorch's wheel (targets ampx-train, ampx_gemm_peak, "
                        "ampx_fp8_bench): the main anchor's C++ side (parts 'wheel', 'fp8')")
    p.add_argument("--wheel-python", default=None,
                   help="the wheel's Python (scripts/wheel-env.sh --python): eager and "
                        "torch.compile'd runs of the same models (part 'wheel'), torchao's FP8 "
                        "Linear (part 'fp8')")
    p.add_argument("--wheel-adamw", default="default,fused",
                   help="the AdamW implementations the wheel's Python runs, each in every "
                        "configuration (eager and compiled, fp32 and autocast bf16): torch's "
                        "default and AdamW(fused=True), skipped where that torch has none on "
                        "the CPU (before 2.4); 'default' alone halves part 'wheel''s Python runs "
                        "[default: default,fused]")
    p.add_argument("--forky-train", default=os.path.join(ROOT, "build", "forky", "apps",
                                                         "ampx-train", "ampx-train"),
                   help="the forky chroot's ampx-train (LibTorch 2.14), run beside the wheel's "
                        "when built: ampx on the wheel vs on 2.14")
    p.add_argument("--only",
                   default="gemm,micro,fp8,e2e,python,wheel,kernels,dist,sharding,debug,attention",
                   help="comma-separated parts to run (the report covers what ran)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes and steps: checks the harness end to end in a few minutes")
    fp8.add_args(p)
    args = p.parse_args()
    wheel.check_args(args, p)
    fp8.check_args(args, p)
    args.workloads = [w for w in args.workloads.split(",") if w]
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"--workloads: unknown '{w}'; expected some of {', '.join(WORKLOADS)}")
    # --quick's sizes where no flag gave one (a quick run on a slow machine may want fewer)
    for name, full, quick in (("gpt_steps", 40, 8), ("image_steps", 100, 12), ("rounds", 3, 1),
                              ("debug_steps", 20, 6), ("gpt_batch", None, 4)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.quick:
        harness.RETRIES = 0
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.cpu_kind is not None and not (args.cpu_kind.replace("-", "").isalnum()
                                          and args.cpu_kind == args.cpu_kind.lower()):
        p.error(f"--cpu-kind: '{args.cpu_kind}' is not a name of lower-case letters, digits "
                "and '-' (it names the run's files)")
    parts = set(args.only.split(","))
    os.makedirs(args.out, exist_ok=True)
    data = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "command": "bench/run_all.py " + " ".join(sys.argv[1:]) if sys.argv[1:] else
            "make bench",
            "gemm": {}, "micro": {}, "e2e": {}, "python": {}, "dist": None, "debug": None,
            "attention": None, "wheel": None, "what_ran": None, "parts": sorted(parts)}
    if "gemm" in parts:
        data["gemm"] = gemm_peaks(args, args.out)
    if "micro" in parts:
        data["micro"] = micro(args, args.out)
    data["fp8"] = fp8.measure(args, args.out) if "fp8" in parts else None  # minutes: before e2e
    end_to_end(args, parts, data)
    data["rounds"] = args.rounds
    if "dist" in parts:
        data["dist"] = dist(args, args.out)
    if "sharding" in parts:
        data["sharding"] = sharding.measure(args, args.out)
    if "debug" in parts:
        data["debug"] = {w: debug_cost(args, args.out, w) for w in args.debug_workloads.split(",")}
    if "attention" in parts:
        data["attention"] = attention.measure(args, args.out)
    data["machine"] = machine(args, data["gemm"], data["e2e"])
    data["commit"] = git_commit()
    data["foreign_load"] = [[name, round(load, 3)] for name, load in FOREIGN]
    data["targets"] = targets(data)
    write_docs(args, data)
    for t in data["targets"]:
        log(f"{status(t, plain=True):<12} {t['what']}: {t['measured']} (target {t['target']})")


if __name__ == "__main__":
    main()
