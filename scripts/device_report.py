#!/usr/bin/env python3
"""Summarises a scripts/device-run.sh output folder as markdown (stdout) and
OUT/summary.json: the tests' result, GPU matrix-product peaks, ampx's fused
AdamW against PyTorch's, FP8 against bf16, and ampx-train's modes against
the same model in Python (torch.autocast), with MFU against the measured bf16
peak, and the CPU comparison (--part cpu) against the same LibTorch's
Python. Says what did not run and why. Standard library only (torch, when
it imports, only names the GPU and the CUDA version).

  scripts/device_report.py OUT > OUT/summary.md
"""
import glob
import json
import os
import re
import statistics
import sys
import xml.etree.ElementTree as ET

# The model FLOPs of a step are bench/e2e.py's, the one formula `make bench`
# reports MFU with too.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from e2e import gpt_flops_per_step  # noqa: E402
from harness import fmt  # noqa: E402  (the benchmarks' one number format)

# ampx-train mode -> the Python precision it is compared with (same dtype).
PAIRS = {"fp32": "fp32", "O1": "autocast-fp16", "O2": "autocast-fp16", "O3": "autocast-fp16",
         "O1-bf16": "autocast-bf16", "O2-bf16": "autocast-bf16", "fp8-bf16": "autocast-bf16"}
CPU_PAIRS = {"fp32": "fp32", "O1": "autocast-bf16", "O2": "autocast-bf16", "O3": "autocast-bf16"}


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def tests_summary(out, skipped, name="ctest-junit.xml"):
    """The test cases of a JUnit file (ctest's, or a gtest binary's XML)."""
    path = os.path.join(out, name)
    if not os.path.exists(path):
        skipped.append(f"tests: not run in this call (no {name})")
        return None
    root = ET.parse(path).getroot()
    cases = list(root.iter("testcase"))

    def label(c):  # gtest's cases name their suite in classname, ctest's repeat the name
        suite = c.get("classname")
        return c.get("name") if suite in (None, "", c.get("name")) else f"{suite}.{c.get('name')}"
    failed = [label(c) for c in cases if c.find("failure") is not None]
    skips = [label(c) for c in cases
             if c.get("status") == "notrun" or c.find("skipped") is not None]
    return {"tests": len(cases), "failed": failed, "skipped": skips}


def gpt_flops_per_token(model):
    """bench/e2e.py's gpt_flops_per_step for one sequence, per token: the
    matrix products (qkv, proj, MLP, the head; not the embeddings' lookups)
    and attention's two, forward and backward."""
    if not model or not all(k in model for k in ("block_size", "layers", "d_model", "vocab")):
        return None
    t = model["block_size"]
    return gpt_flops_per_step(1, block=t, layers=model["layers"], d=model["d_model"],
                              vocab=model["vocab"]) / t


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def training(out, skipped, sub="train"):
    """ampx-train's and Python's runs under OUT/sub, medians over rounds."""
    ampx, python = {}, {}
    for path in sorted(glob.glob(os.path.join(out, sub, "ampx-*-r*", "compare.json"))):
        run = os.path.basename(os.path.dirname(path))
        mode = re.match(r"ampx-(.+)-r\d+$", run).group(1)
        data = load(path)
        if not data or not data.get("modes"):
            skipped.append(f"{sub}/{run}: no result")
            continue
        m = data["modes"][0]
        ampx.setdefault(mode, []).append({
            "step_ms": m.get("median_step_ms"),
            "items_per_s": m.get("tokens_per_s") or m.get("samples_per_s") or m.get("items_per_s"),
            "peak_bytes": m.get("peak_allocated_bytes"), "train_loss": m.get("train_loss"),
            "device": data.get("settings", {}).get("device")})
    model, params = None, None
    for path in sorted(glob.glob(os.path.join(out, sub, "python-*-r*.json"))):
        name = re.match(r"python-(.+)-r\d+\.json$", os.path.basename(path)).group(1)
        data = load(path)
        if not data:
            skipped.append(f"{sub}/{os.path.basename(path)}: no result")
            continue
        model, params = data.get("model"), data.get("parameters")
        python.setdefault(name, []).append({
            "step_ms": data.get("median_step_ms"), "items_per_s": data.get("items_per_s"),
            "peak_bytes": data.get("peak_bytes"), "train_loss": data.get("train_loss"),
            "device": data.get("device"), "gpu": data.get("gpu"),
            "optimizer": data.get("optimizer", {}).get("impl")})
    for log in sorted(glob.glob(os.path.join(out, sub, "*.log"))):
        name = os.path.basename(log)[:-4]
        if not (os.path.exists(os.path.join(out, sub, name, "compare.json"))
                or os.path.exists(os.path.join(out, sub, name + ".json"))):
            with open(log, errors="replace") as f:
                tail = f.read().strip().splitlines()[-1:] or ["(empty log)"]
            skipped.append(f"{sub}/{name}: failed: {tail[0][:200]}")

    def agg(runs):
        return {k: median([r[k] for r in runs]) for k in ("step_ms", "items_per_s", "peak_bytes",
                                                          "train_loss")}
    return ({k: agg(v) for k, v in ampx.items()}, {k: agg(v) for k, v in python.items()},
            model, params, python)


def shape_of(model, default):
    """A gpt's shape as the tables name it, from a Python run's "model"."""
    if not model:
        return default
    return (f"{model['layers']} layers, d {model['d_model']}, {model['heads']} heads, "
            f"context {model['block_size']}")


def comparison_table(w, ampx, python, pairs, mfu=None):
    """Python's runs, then ampx's, each ampx mode against its Python twin in
    `pairs`; an MFU column where `mfu` (a run -> fraction or None) is given."""
    mfu_head, mfu_rule = (" MFU |", " ---: |") if mfu else ("", "")
    w(f"| run | step ms | tokens/s |{mfu_head} peak MiB | train loss | vs Python |")
    w(f"| --- | ---: | ---: |{mfu_rule} ---: | ---: | ---: |")
    rows = {f"python {k}": v for k, v in sorted(python.items())}
    rows.update({f"ampx {k}": v for k, v in sorted(ampx.items())})
    for label, r in rows.items():
        vs = ""
        if label.startswith("ampx "):
            twin = python.get(pairs.get(label[5:], ""))
            if twin and twin["step_ms"] and r["step_ms"]:
                vs = f"{twin['step_ms'] / r['step_ms']:.2f}x ({pairs[label[5:]]})"
        cell = ""
        if mfu:
            m = mfu(r)
            cell = f" {fmt(100 * m if m else None, 0)}{'%' if m else ''} |"
        peak = r["peak_bytes"] / 2**20 if r["peak_bytes"] else None
        w(f"| {label} | {fmt(r['step_ms'])} | {fmt(r['items_per_s'], 0)} |{cell} "
          f"{fmt(peak)} | {fmt(r['train_loss'], 4)} | {vs} |")
    w("")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    skipped = []
    summary = {"out": out}
    gpu, cuda_version, torch_version = None, None, None
    try:
        import torch
        torch_version = torch.__version__
        cuda_version = torch.version.cuda
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
    except Exception as e:  # noqa: BLE001 - the report must come out regardless
        skipped.append(f"torch did not import here ({e}): GPU and CUDA version unnamed")
    commit = os.popen("git -c safe.directory='*' -C " + os.path.dirname(os.path.abspath(__file__))
                      + " rev-parse --short HEAD 2>/dev/null").read().strip() or "unknown"
    summary.update({"gpu": gpu, "cuda": cuda_version, "torch": torch_version, "commit": commit})
    w = print
    w(f"## On a GPU: {gpu or 'no GPU (CPU rehearsal)'}\n")
    w(f"PyTorch {torch_version}, CUDA {cuda_version}, ampx {commit}; `scripts/device-run.sh`.\n")

    for key, name, title in (
            ("focus_tests", "focus-tests.xml",
             "GPU tests and tests that write files (`ampx_tests`, gtest cases)"),
            ("tests", "ctest-junit.xml", "Tests (ctest)")):
        if key == "focus_tests" and not os.path.exists(os.path.join(out, name)):
            continue  # only scripts/device-call.sh runs them
        tests = tests_summary(out, skipped, name)
        summary[key] = tests
        if tests:
            w(f"### {title}\n\n{tests['tests']} tests, {len(tests['failed'])} failed, "
              f"{len(tests['skipped'])} skipped.\n")
            for failed in tests["failed"]:
                w(f"- failed: `{failed}`")
            if tests["failed"]:
                w("")

    bench = load(os.path.join(out, "gpu-bench.json"))
    bf16_peak = None
    if not bench:
        skipped.append("ampx_gpu_bench: no output")
    elif "skipped" in bench:
        skipped.append(f"ampx_gpu_bench: skipped ({bench['skipped']})")
    else:
        summary["gpu_bench"] = bench
        w("### Matrix-product peaks (square, median of the timed calls)\n")
        w("| kind | n | TFLOP/s |\n| --- | ---: | ---: |")
        for p in bench["peaks"]:
            w(f"| {p['kind']} | {p['n']} | {p['tflops']:.1f} |")
        bf16_peak = max(p["tflops"] for p in bench["peaks"] if p["kind"] == "bf16")
        o = bench["optimizer"]
        w(f"\n### AdamW step, GPT-2 small's {o['tensors']} tensors ({o['elements'] / 1e6:.1f}M "
          "elements)\n")
        w("| step | ms | bytes/element | GB/s |\n| --- | ---: | ---: | ---: |")
        for key, label in (("ampx", "ampx fused (bf16 params, fp32 masters + moments)"),
                           ("torch_fused_adamw_plus_copy", "torch `_fused_adamw_` on fp32 + bf16 copy"),
                           ("copy", "device copy of the same bytes")):
            r = o.get(key, {})
            if "ms" in r:
                w(f"| {label} | {r['ms']:.3f} | {r['bytes_per_element']} | {r['gb_per_s']:.0f} |")
            else:
                skipped.append(f"optimizer {key}: {r.get('skipped', 'not run')}")
        if "ampx_speedup_vs_torch" in o:
            w(f"\nampx / torch: {o['ampx_speedup_vs_torch']:.2f}x; ampx at "
              f"{100 * o['ampx_fraction_of_copy_bandwidth']:.0f}% of copy bandwidth.")
        w("")

    fp8 = load(os.path.join(out, "fp8-bench.json"))
    if fp8 and fp8.get("device") == "cuda":
        summary["fp8"] = fp8
        w(f"### FP8 Linear against bf16 ({fp8['tokens']} tokens, GPT-2 small shapes, 4096 and 8192 wide)\n")
        w("| layer | bf16 ms | fp8 ms | speedup | fp8: casts ms | scaling ms | products and rest ms "
          "| fp8, weight kept ms | speedup |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for s in fp8["shapes"]:
            parts = " | ".join(f"{s[k]:.3f}" if k in s else "-"
                               for k in ("cast_ms", "scaling_ms", "rest_ms", "fp8_kept_ms"))
            kept = f"{s['kept_speedup']:.2f}x" if "kept_speedup" in s else "-"
            w(f"| {s['name']} | {s['bf16_ms']:.3f} | {s['fp8_ms']:.3f} | {s['speedup']:.2f}x | {parts} | {kept} |")
        w(f"\nGPT-2 small block: {fp8['block_speedup']:.2f}x ({fp8['scaled_mm_calls']} `_scaled_mm` calls)\n")
    elif fp8:
        skipped.append("FP8 on tensor cores: no CUDA device (the CPU emulation ran)")
    else:
        skipped.append("ampx_fp8_bench: no output")
    trace = os.path.join(out, "fp8-profile.json")
    if fp8 and fp8.get("device") == "cuda" and os.path.exists(trace):
        import fp8_profile  # beside this script
        profile = fp8_profile.summarize(trace)
        summary["fp8_profile"] = profile
        w("### Where an FP8 block's time goes (`ampx_fp8_bench --profile`, Kineto)\n")
        fp8_profile.markdown(profile, w)

    ampx, python, model, params, _ = training(out, skipped)
    if ampx or python:
        device = "cuda" if gpu else "cpu"
        pairs = PAIRS if device == "cuda" else CPU_PAIRS
        flops = gpt_flops_per_token(model)
        w(f"### ampx-train against torch.autocast ({shape_of(model, 'gpt')}; medians over "
          "rounds)\n")

        def mfu(r):
            return (r["items_per_s"] * flops / (bf16_peak * 1e12)
                    if flops and bf16_peak and r["items_per_s"] else None)
        comparison_table(w, ampx, python, pairs, mfu)
        summary["training"] = {"ampx": ampx, "python": python, "flops_per_token": flops}
    else:
        skipped.append("training comparison: no run")

    # The CPU comparison (--part cpu): OUT/cpu-tN/<workload>/, against the
    # same wheel's torch.autocast (bf16), no MFU (no CPU peak measured here).
    cpu = {}
    for folder in sorted(glob.glob(os.path.join(out, "cpu-t*", "*")),
                         key=lambda f: (int(re.search(r"cpu-t(\d+)", f).group(1)), f)):
        sub = os.path.relpath(folder, out)
        threads, workload = re.match(r"cpu-t(\d+)/(.+)$", sub).groups()
        c_ampx, c_python, c_model, _, _ = training(out, skipped, sub)
        if not (c_ampx or c_python):
            continue
        cpu[sub] = {"ampx": c_ampx, "python": c_python}
        w(f"### CPU, {threads} thread{'' if threads == '1' else 's'}: {workload} "
          f"({shape_of(c_model, workload)}) against torch.autocast on the same LibTorch\n")
        comparison_table(w, c_ampx, c_python, CPU_PAIRS)
    if cpu:
        summary["cpu"] = cpu

    summary["skipped"] = skipped
    if skipped:
        w("### Not run, or failed\n")
        for s in skipped:
            w(f"- {s}")
        w("")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
