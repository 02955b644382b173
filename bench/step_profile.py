"""Where each side's step goes: the ops with the most self time in one profiled step of each
configuration, for the report (issue 39: a missed target comes with a profile of each side).

ampx-train --profile writes a Chrome trace of one step per mode (left out of its timing);
torch_amp_bench.py profiles one extra step after the timed ones and keeps its top ops
(op_self_ms). Both are LibTorch's profiler; self time is an op's time less the ops it called,
so the rows of one step add up to the step.

Only the standard library: run_all.py imports it under any python3.

    top = trace_self_times("runs/bench/profiles/gpt-wheel-O2.json")   # [[name, calls, ms], ...]
"""
import json
import os

from harness import fmt

TOP = 8  # rows per configuration in the report


def trace_self_times(path, top=20):
    """The `top` ops with the most self time in a Chrome trace (complete events, 'ph' X):
    [[name, calls, self ms], ...]; [] when the file is missing or unreadable."""
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, ValueError):
        return []
    events = trace if isinstance(trace, list) else trace.get("traceEvents", [])
    return self_times([e for e in events if e.get("ph") == "X"], top)


def self_times(events, top=20):
    """The `top` names with the most self time among complete events (each with ts, dur, pid,
    tid): an event's time less that of the events nested in it on its thread."""
    by_thread = {}
    for e in events:
        if "dur" in e and "ts" in e:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    totals = {}  # name: [calls, self us]
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [event, children's time]
        for e in evs + [None]:
            while stack and (e is None or e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]):
                done, children = stack.pop()
                t = totals.setdefault(done["name"], [0, 0.0])
                t[0] += 1
                t[1] += done["dur"] - children
                if stack:
                    stack[-1][1] += done["dur"]
            if e is not None:
                stack.append([e, 0.0])
    rows = sorted(([n, c, us / 1000.0] for n, (c, us) in totals.items()), key=lambda r: -r[2])
    return rows[:top]


def ampx_profile_path(out, workload, tag):
    """The --profile path of `workload`'s first-round ampx-train run; ampx-train writes one
    trace per mode, <stem>-<mode>.json."""
    return os.path.join(out, "profiles", f"{workload}-ampx-{tag}.json")


def ampx_profiles(out, workload, tag, modes):
    """{mode: top self times} of the traces ampx-train wrote for `workload`."""
    stem = ampx_profile_path(out, workload, tag)[:-len(".json")]
    return {m: trace_self_times(f"{stem}-{m}.json") for m in modes}


def report(profiles):
    """The report's section: per workload, each configuration's top ops by self time.
    profiles: {workload: {configuration: [[name, calls, ms], ...]}}."""
    shown = {w: p for w, p in (profiles or {}).items() if any(p.values())}
    if not shown:
        return []
    lines = ["## Where the step goes (one profiled step, the wheel)", ""]
    w = lines.append
    w(f"The {TOP} ops with the most self time (an op's time less the ops it called) in one step "
      "of each configuration, first round, under LibTorch's profiler (which slows a step: "
      "compare shares, not totals). ampx: `ampx-train --profile` (a step after warm-up, left "
      "out of the timing); Python: a step after the timed ones (a compiled graph's generated "
      "code shows as one `CompiledFxGraph` call). Code the profiler does not record (ampx's "
      "fused optimizer step) is missing. Raw traces and tables under the run's `profiles/` "
      "folder.")
    w("")
    for workload, configs in shown.items():
        w(f"<details><summary>{workload}</summary>")
        w("")
        for name, top in configs.items():
            if not top:
                continue
            w(f"**{name}**: " + "; ".join(f"`{r[0][:60]}` {fmt(r[2])} ms ({r[1]}x)"
                                          for r in top[:TOP]))
            w("")
        w("</details>")
        w("")
    return lines
