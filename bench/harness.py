"""Running benchmark programs for run_all.py: each run watched for other load on the machine
(and rerun when there was too much), and several rounds of one configuration made into one
result (the median of the rounds' medians).

Only the standard library: the orchestration runs under any python3.

    text = run([exe, "--json", path])          # stdout; raises SystemExit if it failed
    combined = combine_python([r1, r2, r3])    # median step of three rounds, round_ms kept
"""
import copy
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FOREIGN = []  # (program, foreign load in cores) of every run, for the report
MAX_FOREIGN_CORES = 0.15  # more than this much other work on the machine spoils a timing
RETRIES = 2  # run_all.py --quick sets 0: its numbers mean nothing anyway


def log(*a):
    print("[bench]", *a, file=sys.stderr, flush=True)


def busy_jiffies():
    """System-wide CPU time spent busy (user+nice+system+irq+softirq+steal), in seconds."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def default_label(cmd):
    """'program --workload w --precision p ...' for the report's load list: the script for a
    Python interpreter, the program for the chroot wrapper."""
    i = 0
    while i + 1 < len(cmd) and (os.path.basename(cmd[i]).startswith("python")
                                or cmd[i].endswith("chroot.sh") or cmd[i] == "forky"):
        i += 1
    label = os.path.basename(cmd[i])
    for flag in ("--workload", "--precision", "--benchmark_filter"):
        if flag in cmd:
            label += " " + cmd[cmd.index(flag) + 1]
    label += "".join(" " + a for a in cmd if a.startswith("--optimizer=") or a == "--compile")
    return label


def run(cmd, label=None, **kw):
    """Runs a benchmark program; reruns it (up to RETRIES times) when other processes took more
    than MAX_FOREIGN_CORES of the machine meanwhile (busy time not spent by our own children).
    label names it in the load list (default: default_label)."""
    for attempt in range(RETRIES + 1):
        log(" ".join(cmd))
        t0, b0, c0 = time.time(), busy_jiffies(), children_cpu()
        p = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, **kw)
        wall = time.time() - t0
        foreign = max(0.0, (busy_jiffies() - b0) - (children_cpu() - c0)) / max(wall, 1e-3)
        if p.returncode != 0:
            sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
            raise SystemExit(f"bench: {cmd[0]} failed with exit code {p.returncode}")
        log(f"  {wall:.0f} s, foreign load {foreign:.2f} cores")
        if foreign <= MAX_FOREIGN_CORES or attempt == RETRIES:
            break
        log(f"  other processes loaded the machine; running it again")
    FOREIGN.append((label or default_label(cmd), foreign))
    return p.stdout


def rescale(result, ms):
    """`result` with its median step set to `ms` (throughputs follow)."""
    old = result["median_step_ms"]
    for k in list(result):
        if k.endswith("_per_s") and isinstance(result[k], (int, float)):
            result[k] = result[k] * old / ms
    result["median_step_ms"] = ms


def combine_e2e(rounds):
    """One ampx-train --compare result from several rounds: each mode's median step is the
    median of its rounds' (kept in round_ms); the rest is the first round's."""
    out = copy.deepcopy(rounds[0])
    for m in out["modes"]:
        ms = [next(x for x in r["modes"] if x["mode"] == m["mode"])["median_step_ms"]
              for r in rounds]
        rescale(m, statistics.median(ms))
        m["round_ms"] = ms
    base = next((x for x in out["modes"] if x["mode"] == out.get("baseline", "fp32")), None)
    for m in out["modes"]:
        if base and "speedup" in m:
            m["speedup"] = base["median_step_ms"] / m["median_step_ms"]
    return out


def combine_python(rounds):
    """One torch_amp_bench result from several rounds, as combine_e2e; a compiled run's
    compile times are kept per round (compile_s_rounds: the first round's cache is cold)."""
    out = copy.deepcopy(rounds[0])
    ms = [r["median_step_ms"] for r in rounds]
    rescale(out, statistics.median(ms))
    out["round_ms"] = ms
    if out.get("compile"):
        out["compile"]["compile_s_rounds"] = [r["compile"]["compile_s"] for r in rounds]
    return out


def fmt(x, digits=1):
    """A number as every report writes it (bench/ and scripts/device_report.py):
    `digits` after the point, thousands grouped; "-" for None (not measured)."""
    return "-" if x is None else f"{x:,.{digits}f}"


def target_row(what, target, value, threshold, higher_is_better=True, unit="x", note="",
               group=""):
    """One row of the report's targets: `value` (a ratio, or a fraction with unit '%') against
    `threshold`; None is reported as not measured (and not met), never guessed."""
    if value is None:
        return {"what": what, "target": target, "measured": "not measured", "met": False,
                "value": None, "note": note, "group": group}
    met = value >= threshold if higher_is_better else value <= threshold
    shown = f"{100 * value:.1f}%" if unit == "%" else f"{value:.2f}x"
    return {"what": what, "target": target, "measured": shown, "met": met, "value": value,
            "note": note, "group": group}
