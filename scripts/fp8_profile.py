#!/usr/bin/env python3
"""Where an FP8 layer's time goes: a summary of the Chrome trace that
`ampx_fp8_bench --profile TRACE` writes (LibTorch's Kineto profiler around
three forward + backward passes of the FP8 block), as markdown:

- the profiled passes' wall time, and how much of it the GPU was busy
  (kernels, copies and fills, overlaps counted once);
- the GPU kernels with the most time (on CUDA);
- the CUDA runtime calls (a synchronising call here means a host wait);
- the ATen ops with the most self time on the CPU.

Standard library only (bench/step_profile.py counts the ops' self times).

  scripts/fp8_profile.py TRACE.json [--passes 3] [--top 12]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from step_profile import self_times  # noqa: E402

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def events_of(path):
    with open(path) as f:
        trace = json.load(f)
    events = trace if isinstance(trace, list) else trace.get("traceEvents", [])
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def busy_us(intervals):
    """The length of the union of [start, end) intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def by_name(events, top):
    totals = {}
    for e in events:
        t = totals.setdefault(e["name"], [0, 0.0])
        t[0] += 1
        t[1] += e["dur"]
    rows = sorted(([n, c, us / 1000.0] for n, (c, us) in totals.items()), key=lambda r: -r[2])
    return rows[:top]


def summarize(path, passes=3, top=12):
    """{wall_ms, gpu_busy_ms, kernels, runtime, cpu_ops, passes} of one trace."""
    events = events_of(path)
    cpu = [e for e in events if e.get("cat") == "cpu_op"]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    spans = cpu + gpu
    wall = (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) if spans else 0.0
    return {
        "passes": passes,
        "wall_ms": wall / 1000.0,
        "gpu_busy_ms": busy_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu]) / 1000.0,
        "gpu_events": len(gpu),
        "kernels": by_name(gpu, top),
        "runtime": by_name(runtime, top),
        "cpu_ops": self_times(cpu, top),
    }


def table(w, title, rows):
    if not rows:
        return
    w(f"| {title} | calls | ms |\n| --- | ---: | ---: |")
    for name, calls, ms in rows:
        w(f"| `{name[:90]}` | {calls} | {ms:.3f} |")
    w("")


def markdown(s, w=print):
    per_pass = s["wall_ms"] / s["passes"] if s["passes"] else 0.0
    head = (f"{s['passes']} forward + backward passes of the FP8 block (4 layers): "
            f"{s['wall_ms']:.2f} ms of wall time ({per_pass:.2f} ms a pass)")
    if s["gpu_events"]:
        w(f"{head}; the GPU was busy {s['gpu_busy_ms']:.2f} ms of it "
          f"({100 * s['gpu_busy_ms'] / s['wall_ms']:.0f}%), in {s['gpu_events']} kernels, "
          "copies and fills.\n")
    else:
        w(f"{head}; no GPU activity recorded (CPU run, or CUPTI unavailable).\n")
    table(w, "GPU kernel, copy or fill", s["kernels"])
    table(w, "CUDA runtime call", s["runtime"])
    table(w, "ATen op (self time, CPU)", s["cpu_ops"])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--passes", type=int, default=3, help="passes the trace holds")
    p.add_argument("--top", type=int, default=12, help="rows per table")
    a = p.parse_args()
    markdown(summarize(a.trace, a.passes, a.top))


if __name__ == "__main__":
    main()
