"""Causal attention by shape (ampx_attention_bench): what run_all.py runs for its part
'attention', and that part of the report.

ampx's fused kernel against the explicit ops (matmul, masked_fill, softmax, matmul) on this
build's LibTorch (Debian's 1.13), and on --forky-build's in the forky chroot (LibTorch 2.14),
where LibTorch's own at::scaled_dot_product_attention is a third path.

Only the standard library: the orchestration runs under any python3.

    results = measure(args, out)     # [ampx_attention_bench's JSON, one per LibTorch]
    lines += report(results)         # a table per LibTorch
"""
import json
import os

from harness import ROOT, fmt, log, run


def measure(args, out):
    """ampx_attention_bench on this build, and in the forky chroot on --forky-build's (LibTorch
    2.14: its SDPA as a third path), when that build has it."""
    results = []
    flags = ["--threads", str(args.threads)] + (["--rounds", "1", "--reps", "1"] if args.quick
                                                 else [])
    host = os.path.join(args.build, "bench", "ampx_attention_bench")
    if os.path.exists(host):
        path = os.path.join(out, "attention-host.json")
        run([host] + flags + ["--json", path])
        with open(path) as f:
            results.append(json.load(f))
    else:
        log("ampx_attention_bench not built, skipped")
    forky = os.path.join(args.forky_build, "bench", "ampx_attention_bench")
    rel_out, rel_exe = os.path.relpath(out, ROOT), os.path.relpath(forky, ROOT)
    if not os.path.exists(forky):
        log(f"{forky} not built (make bench builds it), attention on 2.14 skipped")
    elif rel_out.startswith("..") or rel_exe.startswith(".."):
        log("--out or --forky-build outside the repository (the chroot sees only it): "
            "attention on 2.14 skipped")
    else:
        path = os.path.join(rel_out, "attention-forky.json")
        run([os.path.join(ROOT, "scripts", "chroot.sh"), "forky", "/src/" + rel_exe] + flags +
            ["--json", "/src/" + path])
        with open(os.path.join(ROOT, path)) as f:
            results.append(json.load(f))
    return results


def report(results):
    """The report's section: one table per LibTorch that ran."""
    lines = []
    w = lines.append
    for a in results:
        paths = [p for p in ("ampx", "sdpa", "explicit") if p in a["cases"][0]]
        w(f"## Causal attention by shape (`ampx_attention_bench`, LibTorch {a['libtorch']})")
        w("")
        w(f"Forward and backward to the projection's gradient, {a['threads']} threads, median of "
          f"{a['rounds']} interleaved rounds of {a['reps']}; 4096 tokens (B x T) and width 256 "
          "(H x E) in every row. `sdpa`: LibTorch's `at::scaled_dot_product_attention` "
          "(the backend it picked in `via`); `explicit`: matmul, masked_fill, softmax, matmul. "
          "Ratios above 1: ampx is faster.")
        w("")
        head = " | ".join(f"{p} ms" for p in paths)
        ratios = [p for p in paths if p != "ampx"]
        w(f"| dtype | B | T | H | E | {head} | "
          + " | ".join(f"{p} / ampx" for p in ratios) + (" | sdpa via |" if "sdpa" in paths
                                                         else " |"))
        w("| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in paths + ratios)
          + (" | --- |" if "sdpa" in paths else " |"))
        for c in a["cases"]:
            ms = {p: c[p]["ms"] for p in paths}
            w(f"| {c['dtype']} | {c['batch']} | {c['context']} | {c['heads']} | {c['head_size']} | "
              + " | ".join(fmt(ms[p], 2) for p in paths) + " | "
              + " | ".join(f"{ms[p] / ms['ampx']:.2f}x" for p in ratios)
              + (f" | {c['sdpa_backend']} |" if "sdpa" in paths else " |"))
        w("")
    return lines
