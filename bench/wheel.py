"""PyTorch's wheel as the anchor of the end-to-end comparison (issue 39): what run_all.py runs
on it, the targets measured against it, and its part of the report.

On every workload, once per round and interleaved with the Debian 1.13 runs:
  - ampx-train built against the wheel's LibTorch (--wheel-build), every mode;
  - the wheel's Python (--wheel-python) on the same models (bench/python): eager fp32, eager
    torch.autocast bf16, torch.compile'd fp32 and torch.compile'd autocast bf16;
  - ampx-train built against Debian's LibTorch 2.14 in the forky chroot (--forky-train), every
    mode, when that build exists: the "no slower than on 2.14" target.
Inductor's cache lives in the run's output folder and starts empty, so the first round's
compile is a cold one and later rounds show the cached one.

Only the standard library: the orchestration runs under any python3.
"""
import json
import os
import shutil

import e2e
import step_profile
from e2e import GPT_WORKLOADS, MODES, WORKLOADS, step_of
from harness import ROOT, combine_e2e, combine_python, fmt, log, run, target_row

# (precision, compiled) of the wheel's Python runs, in the order they run and are shown.
PY_CONFIGS = [("fp32", False), ("autocast-bf16", False), ("fp32", True), ("autocast-bf16", True)]
GROUP = "PyTorch's wheel"


def config_key(precision, compiled):
    return ("compiled " if compiled else "eager ") + precision


def enabled(args):
    return bool(args.wheel_build and args.wheel_python)


def check_args(args, parser):
    """Both wheel arguments or neither, each naming what exists."""
    if bool(args.wheel_build) != bool(args.wheel_python):
        parser.error("--wheel-build and --wheel-python go together")
    if not enabled(args):
        return
    exe = ampx_train_of(args.wheel_build)
    if "wheel" in args.only.split(",") and not os.path.exists(exe):
        parser.error(f"--wheel-build {args.wheel_build}: no {exe} (build the targets ampx-train "
                     "and ampx_gemm_peak there)")
    if not os.access(args.wheel_python, os.X_OK):
        parser.error(f"--wheel-python {args.wheel_python}: not an executable")


def ampx_train_of(build):
    return os.path.join(build, "apps", "ampx-train", "ampx-train")


def forky_train(args):
    """The forky chroot's ampx-train (LibTorch 2.14), when it is built and inside the
    repository (the chroot sees only it); None otherwise, with the reason logged."""
    exe = args.forky_train
    if not exe or not os.path.exists(exe):
        log(f"{exe} not built: ampx on 2.14 not measured")
        return None
    if os.path.relpath(exe, ROOT).startswith("..") or \
            os.path.relpath(os.path.abspath(args.out), ROOT).startswith(".."):
        log("--forky-train or --out outside the repository (the chroot sees only it): ampx on "
            "2.14 not measured")
        return None
    return exe


def python_env(out):
    """The environment of the wheel's Python runs: inductor's cache in this run's folder."""
    return dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(out, "inductor-cache"))


def start(args, out):
    """Empties inductor's cache of this run (the first compile of the run is a cold one)."""
    shutil.rmtree(os.path.join(out, "inductor-cache"), ignore_errors=True)
    return {"e2e": {w: [] for w in WORKLOADS}, "forky": {w: [] for w in WORKLOADS},
            "python": {w: {config_key(*c): [] for c in PY_CONFIGS} for w in WORKLOADS}}


def run_round(args, out, workload, rnd, rounds, forky_exe):
    """One round of `workload` on the wheel's side: ampx, then each Python configuration, then
    ampx on 2.14 when it is built. The first round also profiles one step of each (untimed)."""
    first = rnd == 0
    os.makedirs(os.path.join(out, "profiles"), exist_ok=True)
    rounds["e2e"][workload].append(e2e.ampx_train(
        ampx_train_of(args.wheel_build), args, out, workload, rnd, tag="wheel",
        profile=step_profile.ampx_profile_path(out, workload, "wheel") if first else None))
    env = python_env(out)
    for precision, compiled in PY_CONFIGS:
        key = config_key(precision, compiled)
        table = os.path.join(out, "profiles", f"{workload}-python-wheel-{key.replace(' ', '-')}.txt")
        rounds["python"][workload][key].append(
            e2e.python_amp(args.wheel_python, args, out, workload, precision, rnd, tag="wheel",
                           compiled=compiled, env=env, op_profile=table if first else None))
    if forky_exe:
        rounds["forky"][workload].append(
            e2e.ampx_train(forky_exe, args, out, workload, rnd, tag="forky", chroot="forky"))


def combine(args, out, rounds, gemm):
    """performance.json's "wheel": each configuration's rounds combined, and the first
    round's profiles (step_profile.report's input)."""
    first = next((r for w in WORKLOADS for r in rounds["python"][w]["eager fp32"]), {})
    profiles = {}
    for w in WORKLOADS:
        if rounds["e2e"][w]:
            profiles[w] = {f"ampx {m}": top for m, top in
                           step_profile.ampx_profiles(out, w, "wheel", MODES).items()}
        for key, r in rounds["python"][w].items():
            if r:
                profiles.setdefault(w, {})[f"PyTorch {key}"] = r[0].get("op_self_ms", [])
    return {
        "python": args.wheel_python, "build": args.wheel_build,
        "torch_version": first.get("torch_version"),
        "gemm": gemm,
        "e2e": {w: combine_e2e(r) for w, r in rounds["e2e"].items() if r},
        "python_runs": {w: {k: combine_python(r) for k, r in cfg.items() if r}
                        for w, cfg in rounds["python"].items() if any(cfg.values())},
        "forky_e2e": {w: combine_e2e(r) for w, r in rounds["forky"].items() if r},
        "forky_train": args.forky_train,
        "profiles": profiles,
    }


def gemm_peaks(args, out, quick):
    """ampx_gemm_peak of the wheel build: the MFU denominators of the wheel's tables (its fp32
    products are MKL's, its bf16 ones oneDNN 3's or LibTorch's own loop)."""
    exe = os.path.join(args.wheel_build, "bench", "ampx_gemm_peak")
    if not os.path.exists(exe):
        log(f"{exe} not built: the wheel's MFU not measured")
        return {}
    path = os.path.join(out, "gemm-wheel.json")
    cmd = [exe, "--threads", str(args.threads), "--json", path]
    if quick:
        cmd += ["--sizes", "256,512", "--reps", "3"]
    run(cmd, label="ampx_gemm_peak (wheel)")
    with open(path) as f:
        return json.load(f)


# --------------------------------------------------------------------- targets
def targets(data):
    """Issue 39's targets, each a ratio of step times measured in this run (above 1: ampx is
    faster), or not measured with the reason."""
    wh = data.get("wheel")
    out = []
    if not wh:
        why = "not run: run_all.py was given no --wheel-build / --wheel-python"
        for what, t in (("gpt and gpt-nn, ampx vs the wheel's Python, eager and compiled",
                         ">= 1.0x / 1.3x"),
                        ("mnist-cnn and fashion-mlp, ampx's best vs Python's best", ">= 1.0x")):
            out.append(target_row(what, t, None, 1.0, note=why, group=GROUP))
        return out
    py = lambda w, k: (wh["python_runs"].get(w, {}).get(k) or {}).get("median_step_ms")
    for w in GPT_WORKLOADS:
        c = wh["e2e"].get(w)
        if c is None:
            continue
        f32 = step_of(c, "fp32")
        best_mode = min((m for m in MODES if m != "fp32"), key=lambda m: step_of(c, m))
        best = step_of(c, best_mode)
        runs = wh["python_runs"].get(w, {})
        kernel = lambda key: (runs.get(key) or {}).get("attention_kernel")
        for what, key, mine, want, note in (
                ("ampx fp32 vs the wheel's eager fp32", "eager fp32", f32, 1.0,
                 f"attention: ampx {c['settings'].get('attention')}; Python "
                 f"{kernel('eager autocast-bf16')}"),
                (f"ampx best mixed ({best_mode}) vs eager torch.autocast bf16",
                 "eager autocast-bf16", best, 1.3, ""),
                (f"ampx best mixed ({best_mode}) vs torch.compile'd autocast bf16",
                 "compiled autocast-bf16", best, 1.0,
                 f"compiled attention: {kernel('compiled autocast-bf16')}")):
            theirs = py(w, key)
            out.append(target_row(
                f"{w}, {what} (step time)", f">= {want:g}x", theirs / mine if theirs else None,
                want, note=(f"{fmt(mine)} vs {fmt(theirs)} ms" + (f"; {note}" if note else "")),
                group=GROUP))
    for w in ("mnist-cnn", "fashion-mlp"):
        c = wh["e2e"].get(w)
        if c is None:
            continue
        mine_mode = min(MODES, key=lambda m: step_of(c, m))
        runs = {k: r["median_step_ms"] for k, r in wh["python_runs"].get(w, {}).items()}
        theirs_key = min(runs, key=runs.get) if runs else None
        out.append(target_row(
            f"{w}, ampx's best mode vs Python's best (eager or compiled)", ">= 1.0x",
            runs[theirs_key] / step_of(c, mine_mode) if runs else None, 1.0,
            note=(f"ampx {mine_mode} {fmt(step_of(c, mine_mode))} ms vs Python {theirs_key} "
                  f"{fmt(runs[theirs_key])} ms" if runs else ""), group=GROUP))
    forky = wh.get("forky_e2e") or {}
    if not forky:
        out.append(target_row(
            "ampx on the wheel vs ampx on Debian's LibTorch 2.14, every mode", ">= 1.0x", None,
            1.0, note=f"no forky build of ampx-train ({wh.get('forky_train')}) in this run",
            group=GROUP))
    for w, fc in forky.items():
        c = wh["e2e"].get(w)
        if c is None:
            continue
        ratios = {m: step_of(fc, m) / step_of(c, m) for m in MODES
                  if step_of(fc, m) and step_of(c, m)}
        worst = min(ratios, key=ratios.get) if ratios else None
        out.append(target_row(
            f"{w}, ampx on the wheel vs on LibTorch 2.14, slowest mode", ">= 1.0x",
            ratios[worst] if worst else None, 1.0,
            note=", ".join(f"{m} {r:.2f}x" for m, r in ratios.items()), group=GROUP))
    return out


# --------------------------------------------------------------------- report
def report(data):
    """The wheel's section of the run's page (docs/performance/cpu-KIND.md): one table per
    workload."""
    wh = data.get("wheel")
    if not wh or not wh["e2e"]:
        return []
    peaks = {"fp32": wh["gemm"].get("fp32_peak_gflops"),
             "bf16": wh["gemm"].get("bf16_peak_gflops")}
    lines = [f"## Against PyTorch's wheel (torch {wh['torch_version']})", ""]
    w = lines.append
    w(f"ampx-train built against the wheel's LibTorch (`{wh['build']}`) next to the wheel's own "
      f"Python (`{wh['python']}`) on the same models and data (`bench/python`): eager and "
      "`torch.compile`'d (inductor; forward and loss compiled, backward through AOTAutograd, "
      "AdamW eager), fp32 and `torch.autocast` bf16."
      + (" `ampx on 2.14`: ampx-train built against Debian's LibTorch 2.14 (forky chroot)."
         if wh.get("forky_e2e") else "")
      + f" MFU against the wheel build's own products: fp32 {fmt(peaks['fp32'])}, bf16 "
        f"{fmt(peaks['bf16'])} GFLOP/s (`ampx_gemm_peak`). `compile s`: the first step's time "
        "less the median step's, in the first round (inductor's cache empty) and the last.")
    w("")
    for workload in WORKLOADS:
        c = wh["e2e"].get(workload)
        if c is None:
            continue
        rows = e2e.ampx_rows(c)
        if workload in wh.get("forky_e2e", {}):
            rows += e2e.ampx_rows(wh["forky_e2e"][workload], prefix="ampx on 2.14", mfu=False)
        for precision, compiled in PY_CONFIGS:
            r = wh["python_runs"].get(workload, {}).get(config_key(precision, compiled))
            if r:
                rows.append(e2e.python_row(f"PyTorch {config_key(precision, compiled)}", r))
        w(f"### {workload} (wheel)")
        w("")
        lines += e2e.workload_table(workload, c["settings"], rows, peaks)
    return lines
