"""PyTorch's wheel as the anchor of the end-to-end comparison (issue 39): what run_all.py runs
on it, the targets measured against it, and its part of the report.

On every workload, once per round and interleaved with the Debian 1.13 runs:
  - ampx-train built against the wheel's LibTorch (--wheel-build), every mode;
  - the wheel's Python (--wheel-python) on the same models (bench/python): eager fp32, eager
    torch.autocast bf16, torch.compile'd fp32 and torch.compile'd autocast bf16, each with
    torch's default AdamW (on the CPU its for-loop) and with AdamW(fused=True) (issue 67;
    --wheel-adamw picks, and a torch without a fused CPU AdamW, before 2.4, skips it);
  - ampx-train built against Debian's LibTorch 2.14 in the forky chroot (--forky-train), every
    mode, when that build exists: the "no slower than on 2.14" target;
  - on the GPTs, ampx-train fp32 and O2 again with each --recompute setting (RECOMPUTE): what
    activation checkpointing takes off O2's peak, and what it costs in step time.
Inductor's cache lives in the run's output folder and starts empty, so the first round's
compile is a cold one and later rounds show the cached one (the fused-AdamW compiled runs
compile the same forward and loss as the default-AdamW ones, after them in each round).

The targets (issue 67) are against Python's best variant per precision: the fastest of eager
and compiled, default and fused AdamW, named in the target's row.

Only the standard library: the orchestration runs under any python3.
"""
import json
import os
import shutil

import e2e
import step_profile
from e2e import GPT_WORKLOADS, MODES, WORKLOADS, step_of
from harness import ROOT, combine_e2e, combine_python, fmt, log, run, target_row

PRECISIONS = ("fp32", "autocast-bf16")
# AdamW implementations (torch_amp_bench.py --adamw-impl) the wheel's Python can run: torch's
# default, and AdamW(fused=True) (torch >= 2.4 on the CPU).
ADAMW = ("default", "fused")
# (precision, compiled, AdamW) of the wheel's Python runs, in the order they run and are shown.
PY_CONFIGS = [(p, c, a) for a in ADAMW for c in (False, True) for p in PRECISIONS]
GROUP = "PyTorch's wheel"
# ampx-train --recompute settings measured beside --recompute none (the ampx rows above them)
# on the GPTs, each with the modes RECOMPUTE_MODES.
RECOMPUTE = ("mlp", "blocks")
RECOMPUTE_MODES = ["fp32", "O2"]


def config_key(precision, compiled, adamw="default"):
    """A configuration's name in performance.json: 'eager fp32', 'compiled autocast-bf16, AdamW
    fused' (the default AdamW's keep the names they had before the fused ones)."""
    return (("compiled " if compiled else "eager ") + precision
            + ("" if adamw == "default" else f", AdamW {adamw}"))


def variant(result):
    """A Python run's name in the report: eager or compiled, the precision and the AdamW that
    ran (torch_amp_bench's optimizer.impl: 'for-loop' for torch's default on the CPU)."""
    impl = (result.get("optimizer") or {}).get("impl", "?")
    how = "compiled" if result.get("compiled") else "eager"
    return f"{how} {result['precision']}, AdamW {impl}"


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
    wrong = [a for a in args.wheel_adamw.split(",") if a not in ADAMW]
    if wrong or not args.wheel_adamw:
        parser.error(f"--wheel-adamw {args.wheel_adamw}: expected some of {', '.join(ADAMW)}")


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


def python_configs(args):
    """(the PY_CONFIGS this run's Python runs, why some AdamW is left out or None): those of
    the AdamW implementations --wheel-adamw names that the wheel's torch has on the CPU. A
    torch without one (fused before 2.4, as Debian's 1.13) skips it, logged and reported."""
    wanted = args.wheel_adamw.split(",")
    has = e2e.adamw_impls(args.wheel_python)
    missing = [a for a in wanted if a not in has]
    skipped = None
    if missing:
        skipped = (f"AdamW {', '.join(missing)} not run: the wheel's torch has none on the CPU "
                   "(fused: torch >= 2.4)")
        log(skipped)
    return [c for c in PY_CONFIGS if c[2] in wanted and c[2] in has], skipped


def start(args, out):
    """Empties inductor's cache of this run (the first compile of the run is a cold one) and
    settles the Python configurations (python_configs)."""
    shutil.rmtree(os.path.join(out, "inductor-cache"), ignore_errors=True)
    configs, skipped = python_configs(args)
    return {"configs": configs, "adamw_skipped": skipped,
            "e2e": {w: [] for w in WORKLOADS}, "forky": {w: [] for w in WORKLOADS},
            "recompute": {w: {rc: [] for rc in RECOMPUTE} for w in GPT_WORKLOADS},
            "python": {w: {config_key(*c): [] for c in configs} for w in WORKLOADS}}


def run_round(args, out, workload, rnd, rounds, forky_exe):
    """One round of `workload` on the wheel's side: ampx (on a GPT, then with each --recompute
    setting), then each Python configuration, then ampx on 2.14 when it is built. The first
    round also profiles one step of each (untimed)."""
    first = rnd == 0
    os.makedirs(os.path.join(out, "profiles"), exist_ok=True)
    exe = ampx_train_of(args.wheel_build)
    rounds["e2e"][workload].append(e2e.ampx_train(
        exe, args, out, workload, rnd, tag="wheel",
        profile=step_profile.ampx_profile_path(out, workload, "wheel") if first else None))
    for rc in rounds["recompute"].get(workload, {}):
        rounds["recompute"][workload][rc].append(e2e.ampx_train(
            exe, args, out, workload, rnd, tag=f"wheel-recompute-{rc}", modes=RECOMPUTE_MODES,
            extra=["--recompute", rc]))
    env = python_env(out)
    for precision, compiled, adamw in rounds["configs"]:
        key = config_key(precision, compiled, adamw)
        slug = key.replace(", ", "-").replace(" ", "-").lower()
        table = os.path.join(out, "profiles", f"{workload}-python-wheel-{slug}.txt")
        rounds["python"][workload][key].append(
            e2e.python_amp(args.wheel_python, args, out, workload, precision, rnd, tag="wheel",
                           compiled=compiled, env=env, op_profile=table if first else None,
                           adamw=adamw))
    if forky_exe:
        rounds["forky"][workload].append(
            e2e.ampx_train(forky_exe, args, out, workload, rnd, tag="forky", chroot="forky"))


def combine(args, out, rounds, gemm):
    """performance.json's "wheel": each configuration's rounds combined, and the first
    round's profiles (step_profile.report's input)."""
    first = next((r for w in WORKLOADS for runs in rounds["python"][w].values() for r in runs),
                 {})
    profiles = {}
    for w in WORKLOADS:
        if rounds["e2e"][w]:
            profiles[w] = {f"ampx {m}": top for m, top in
                           step_profile.ampx_profiles(out, w, "wheel", MODES).items()}
        for r in rounds["python"][w].values():
            if r:
                profiles.setdefault(w, {})[f"PyTorch {variant(r[0])}"] = r[0].get("op_self_ms", [])
    return {
        "python": args.wheel_python, "build": args.wheel_build,
        "torch_version": first.get("torch_version"),
        "gemm": gemm,
        "e2e": {w: combine_e2e(r) for w, r in rounds["e2e"].items() if r},
        "python_runs": {w: {k: combine_python(r) for k, r in cfg.items() if r}
                        for w, cfg in rounds["python"].items() if any(cfg.values())},
        "adamw_skipped": rounds["adamw_skipped"],
        "forky_e2e": {w: combine_e2e(r) for w, r in rounds["forky"].items() if r},
        "recompute_e2e": {w: {rc: combine_e2e(r) for rc, r in settings.items() if r}
                          for w, settings in rounds["recompute"].items()
                          if any(settings.values())},
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
def best_python(runs, precisions):
    """The fastest of one workload's Python runs (python_runs[w]) in `precisions`, or None."""
    timed = [r for r in runs.values() if r["precision"] in precisions and r.get("median_step_ms")]
    return min(timed, key=lambda r: r["median_step_ms"]) if timed else None


def faster_row(what, want, mine, theirs, note=""):
    """A target row: Python's step over ampx's (`mine` ms; `theirs` a Python run or None)."""
    ms = theirs["median_step_ms"] if theirs else None
    return target_row(what, f">= {want:g}x", ms / mine if ms and mine else None, want,
                      note=f"{fmt(mine)} vs {fmt(ms)} ms" + (f"; {note}" if note else ""),
                      group=GROUP)


def memory_rows(w, c, runs, recompute=None):
    """Issue 67's memory targets on a GPT: ampx O2's peak against ampx fp32's and against the
    lowest peak of Python's autocast runs; with each --recompute setting measured (recompute:
    {setting: its fp32 and O2 compare.json}), the same for O2 with it, against the same two
    peaks (fp32's without recompute), its step time and fp32's with the same setting named."""
    peak = {x["mode"]: x.get("peak_allocated_bytes") for x in c["modes"]}
    f32 = peak.get("fp32")
    mib = lambda b: fmt(b / 2**20 if b else None)
    theirs = [r for r in runs.values() if r["precision"] != "fp32" and r.get("peak_bytes")]
    low = min(theirs, key=lambda r: r["peak_bytes"]) if theirs else None
    mixed = best_python(runs, ("autocast-bf16",))
    out = []
    recompute = recompute or {}
    for rc, compare in [(None, c)] + [(rc, recompute[rc]) for rc in RECOMPUTE if rc in recompute]:
        at = {x["mode"]: x for x in compare["modes"]}
        o2_run = at.get("O2") or {}
        o2 = o2_run.get("peak_allocated_bytes")
        label = "ampx O2" + (f" --recompute {rc}" if rc else "")
        note = ""
        if rc:
            ms, same = o2_run.get("median_step_ms"), at.get("fp32") or {}
            py = mixed["median_step_ms"] if mixed else None
            plain = step_of(c, "O2")
            same_peak = same.get("peak_allocated_bytes")
            note = (f"; {fmt(ms)} ms a step, {fmt(plain / ms if plain and ms else None, 2)}x "
                    f"O2's without it, {fmt(py / ms if py and ms else None, 2)}x Python's best "
                    f"mixed; vs fp32 with --recompute {rc}: "
                    f"{fmt(o2 / same_peak if o2 and same_peak else None, 2)}x")
        out.append(target_row(f"{w}, {label} peak memory vs ampx fp32's", "<= 0.55x",
                              o2 / f32 if o2 and f32 else None, 0.55, higher_is_better=False,
                              note=f"{mib(o2)} vs {mib(f32)} MiB{note}", group=GROUP))
        out.append(target_row(
            f"{w}, {label} peak memory vs Python autocast's lowest"
            + (f" ({variant(low)})" if low else ""), "<= 0.8x",
            o2 / low["peak_bytes"] if o2 and low else None, 0.8, higher_is_better=False,
            note=(f"{mib(o2)} vs {mib(low['peak_bytes'])} MiB" if low
                  else "no Python autocast run recorded its peak"), group=GROUP))
    return out


def targets(data):
    """Issue 67's targets, each a ratio measured in this run (step times: above 1, ampx is
    faster; memory: below 1, ampx holds less), against Python's best variant per precision
    (eager or compiled, default or fused AdamW), or not measured with the reason."""
    wh = data.get("wheel")
    out = []
    if not wh:
        why = "not run: run_all.py was given no --wheel-build / --wheel-python"
        for what, t, want in (
                ("gpt and gpt-nn, ampx fp32 vs the wheel's Python's best fp32", ">= 1.2x", 1.2),
                ("gpt and gpt-nn, ampx best mixed vs the wheel's Python's best mixed", ">= 1.5x",
                 1.5),
                ("gpt and gpt-nn, ampx O2 peak memory vs ampx fp32's / Python autocast's",
                 "<= 0.55x / 0.8x", 1.0),
                ("mnist-cnn and fashion-mlp, ampx's best vs Python's best", ">= 1.2x", 1.2)):
            out.append(target_row(what, t, None, want, note=why, group=GROUP))
        return out
    skipped = f"; {wh['adamw_skipped']}" if wh.get("adamw_skipped") else ""
    for w in GPT_WORKLOADS:
        c = wh["e2e"].get(w)
        if c is None:
            continue
        runs = wh["python_runs"].get(w, {})
        best_mode = min((m for m in MODES if m != "fp32"), key=lambda m: step_of(c, m))
        f32, mixed = best_python(runs, ("fp32",)), best_python(runs, ("autocast-bf16",))
        name = lambda r: variant(r) if r else "none ran"
        kernel = lambda r: (r or {}).get("attention_kernel")
        out.append(faster_row(
            f"{w} step time, ampx fp32 vs Python's best fp32 ({name(f32)})", 1.2,
            step_of(c, "fp32"), f32,
            f"attention: ampx {c['settings'].get('attention')}; Python {kernel(f32)}{skipped}"))
        out.append(faster_row(
            f"{w} step time, ampx best mixed ({best_mode}) vs Python's best mixed "
            f"({name(mixed)})", 1.5, step_of(c, best_mode), mixed,
            f"Python's attention: {kernel(mixed)}{skipped}"))
        out += memory_rows(w, c, runs, (wh.get("recompute_e2e") or {}).get(w))
    for w in ("mnist-cnn", "fashion-mlp"):
        c = wh["e2e"].get(w)
        if c is None:
            continue
        mine_mode = min(MODES, key=lambda m: step_of(c, m))
        theirs = best_python(wh["python_runs"].get(w, {}), PRECISIONS)
        out.append(faster_row(
            f"{w} step time, ampx's best mode ({mine_mode}) vs Python's best "
            f"({variant(theirs) if theirs else 'none ran'})", 1.2, step_of(c, mine_mode), theirs,
            skipped[2:]))
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
      "AdamW eager), fp32 and `torch.autocast` bf16, each with torch's default AdamW and with "
      "`AdamW(fused=True)` (each row names the AdamW that ran; the targets take Python's fastest "
      "per precision)."
      + (f" {wh['adamw_skipped']}." if wh.get("adamw_skipped") else "")
      + (" `ampx --recompute S`: the same build with activation checkpointing (`--recompute "
         "mlp`: each block's GELU runs again in backward, under O2 with wide products alone, "
         "elsewhere with the output product; `blocks`: whole "
         "blocks), its peak and step beside the rows without it."
         if wh.get("recompute_e2e") else "")
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
        settings = (wh.get("recompute_e2e") or {}).get(workload, {})
        for rc in (rc for rc in RECOMPUTE if rc in settings):
            rows += e2e.ampx_rows(settings[rc], prefix=f"ampx --recompute {rc}")
        if workload in wh.get("forky_e2e", {}):
            rows += e2e.ampx_rows(wh["forky_e2e"][workload], prefix="ampx on 2.14", mfu=False)
        for precision, compiled, adamw in PY_CONFIGS:
            r = wh["python_runs"].get(workload, {}).get(config_key(precision, compiled, adamw))
            if r:  # python_row adds the AdamW that ran
                rows.append(e2e.python_row(
                    f"PyTorch {'compiled' if compiled else 'eager'} {precision}", r))
        w(f"### {workload} (wheel)")
        w("")
        lines += e2e.workload_table(workload, c["settings"], rows, peaks)
    return lines
