"""The end-to-end comparison's pieces for run_all.py: the workloads and their FLOPs, one run of
ampx-train (every mode) or of bench/python/torch_amp_bench.py (one precision, eager or
compiled, one AdamW implementation), and the per-workload table of the report.

Only the standard library: the orchestration runs under any python3.

    r = ampx_train(exe, args, out_dir, "gpt")                       # compare.json
    p = python_amp(python, args, out_dir, "gpt", "autocast-bf16", compiled=True, adamw="fused")
    adamw_impls(python)                                  # ['default', 'for-loop', 'foreach', ...]
    lines = workload_table("gpt", [row, ...], peaks)                 # markdown
"""
import json
import os
import shutil
import subprocess

from harness import ROOT, fmt, run

MODES = ["fp32", "O1", "O2", "O3"]
# The block-scaled modes (issue 43), on the host's gpt alone: what emulating
# TE's MXFP8, NVFP4 and FP8-block recipes costs against O2.
BLOCK_MODES = ["mxfp8", "nvfp4", "fp8-block"]
# gpt-nn: the GPT built from torch.nn's stock modules (nn.MultiheadAttention,
# nn.GELU, nn.Sequential) on both sides, the comparison's second model.
WORKLOADS = ["gpt", "gpt-nn", "mnist-cnn", "fashion-mlp"]
GPT_WORKLOADS = ("gpt", "gpt-nn")
UNITS = {"gpt": "tokens/s", "gpt-nn": "tokens/s", "mnist-cnn": "images/s",
         "fashion-mlp": "images/s"}
PY_SCRIPT = os.path.join(ROOT, "bench", "python", "torch_amp_bench.py")


# --------------------------------------------------------------------- model FLOPs
def gpt_flops_per_step(batch, block=128, layers=4, d=256, vocab=96):
    """Matrix-product FLOPs of one training step (forward + backward = 3x forward).

    Per token and layer: qkv 3d^2, proj d^2, MLP 8d^2 multiply-adds; attention's two
    batched products T*d each (the full T x T scores are computed, mask or not).
    Plus the vocabulary head d*vocab. A multiply-add is 2 FLOPs."""
    per_token = layers * (12 * d * d + 2 * block * d) + d * vocab
    return 3 * 2 * per_token * batch * block


def cnn_flops_per_step(batch):
    macs = 1 * 32 * 9 * 28 * 28 + 32 * 64 * 9 * 14 * 14 + 64 * 7 * 7 * 128 + 128 * 10
    return 3 * 2 * macs * batch


def mlp_flops_per_step(batch):
    return 3 * 2 * (784 * 512 + 512 * 256 + 256 * 10) * batch


FLOPS = {"gpt": gpt_flops_per_step, "gpt-nn": gpt_flops_per_step, "mnist-cnn": cnn_flops_per_step,
         "fashion-mlp": mlp_flops_per_step}


# --------------------------------------------------------------------- one run
def steps_of(args, workload):
    return args.gpt_steps if workload in GPT_WORKLOADS else args.image_steps


def size_flags(args, workload):
    """--batch-size for the GPTs when run_all.py was given --gpt-batch (--quick: a small one),
    the same on every side; nothing otherwise (each program's default, the same too)."""
    return (["--batch-size", str(args.gpt_batch)] if workload in GPT_WORKLOADS and args.gpt_batch
            else [])


def ampx_train(exe, args, out, workload, rnd=0, tag="", chroot=None, profile=None, block=False,
               modes=None, extra=()):
    """ampx-train --compare fp32,O1,O2,O3 (block: and BLOCK_MODES; modes: that list instead)
    on `workload`, with the flags `extra` after the rest: its compare.json. tag names the
    build (or the variant) in the output folder; chroot ('forky') runs it there
    (exe and out inside the repository, which the chroot sees at /src, and the datasets via
    AMPX_DATA_DIR); profile (a path, host runs only) traces one step per mode (ampx-train
    leaves it out of the timing) into profile-<mode>.json."""
    d = os.path.join(out, "e2e" + (f"-{tag}" if tag else ""),
                     workload if rnd == 0 else f"{workload}-r{rnd}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    modes = modes or MODES + (BLOCK_MODES if block else [])
    flags = ["--workload", workload, "--compare", ",".join(modes), "--steps",
             str(steps_of(args, workload)), "--threads", str(args.threads), "--progress", "none"]
    flags += size_flags(args, workload)
    if workload in GPT_WORKLOADS:
        flags += ["--eval-batches", "4"]
    if profile:
        flags += ["--profile", profile]
    flags += list(extra)
    env = None
    if chroot:
        data_dir = args.data_dir or default_data_dir()
        env = dict(os.environ, AMPX_DATA_DIR=data_dir)
        cmd = [os.path.join(ROOT, "scripts", "chroot.sh"), chroot,
               "/src/" + os.path.relpath(exe, ROOT), "--out-dir", "/src/" + os.path.relpath(d, ROOT),
               "--data-dir", data_dir] + flags
    else:
        cmd = [exe, "--out-dir", d] + flags + (["--data-dir", args.data_dir] if args.data_dir
                                               else [])
    run(cmd, label=f"ampx-train{' ' + tag if tag else ''} {workload}", env=env)
    with open(os.path.join(d, "compare.json")) as f:
        return json.load(f)


def default_data_dir():
    """ampx-train's fallback: $AMPX_DATA_DIR, $XDG_CACHE_HOME/ampx/data, ~/.cache/ampx/data."""
    if os.environ.get("AMPX_DATA_DIR"):
        return os.environ["AMPX_DATA_DIR"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "ampx", "data")


def python_amp(python, args, out, workload, precision, rnd=0, tag="", compiled=False, env=None,
               op_profile=None, adamw="default"):
    """torch_amp_bench.py under the interpreter `python`: its JSON. tag names the torch in
    the output's file name; adamw is its --adamw-impl (default: what that torch picks);
    op_profile (a path) gets the per-op table of its profiled extra step (untimed)."""
    name = (f"{workload}-{'compiled-' if compiled else ''}{precision}"
            + ("" if adamw == "default" else f"-adamw-{adamw}") + (f"-r{rnd}" if rnd else "")
            + ".json")
    path = os.path.join(out, "python" + (f"-{tag}" if tag else ""), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    cmd = [python, PY_SCRIPT, "--workload", workload, "--precision", precision, "--threads",
           str(args.threads), "--steps", str(steps_of(args, workload)), "--json", path]
    cmd += size_flags(args, workload)
    if compiled:
        cmd.append("--compile")
    if adamw != "default":
        cmd += ["--adamw-impl", adamw]
    if op_profile:
        cmd += ["--op-profile", op_profile]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    run(cmd, label=f"torch_amp_bench{' ' + tag if tag else ''} {workload} "
                   f"{'compiled ' if compiled else ''}{precision}"
                   + ("" if adamw == "default" else f", AdamW {adamw}"), env=env)
    with open(path) as f:
        return json.load(f)


def adamw_impls(python):
    """The AdamW implementations (torch_amp_bench.py's --adamw-impl) the torch of the interpreter
    `python` runs on the CPU: 'fused' only from torch 2.4 on (Debian's 1.13 has none)."""
    p = subprocess.run([python, PY_SCRIPT, "--adamw-impls"], cwd=ROOT, text=True,
                       capture_output=True)
    if p.returncode != 0:
        raise SystemExit(f"bench: {python} {PY_SCRIPT} --adamw-impls failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def step_of(compare, mode):
    """A mode's median step (ms) in an ampx-train --compare result, or None."""
    return next((x["median_step_ms"] for x in (compare or {}).get("modes", [])
                 if x["mode"] == mode), None)


# --------------------------------------------------------------------- report
def ampx_rows(compare, prefix="ampx", mfu=True):
    """Table rows (see workload_table) of every mode of an ampx-train --compare result."""
    return [{"label": f"{prefix} {x['mode']}", "ms": x["median_step_ms"],
             "round_ms": x.get("round_ms", []), "peak_bytes": x["peak_allocated_bytes"],
             "dtype": "fp32" if x["mode"] == "fp32" else "bf16", "loss": x["train_loss"],
             "mfu": mfu, "mode": x["mode"]} for x in compare["modes"]]


def python_row(label, result):
    """A table row of one torch_amp_bench result, its label followed by the AdamW that ran."""
    impl = (result.get("optimizer") or {}).get("impl")
    return {"label": label + (f", AdamW {impl}" if impl else ""), "ms": result["median_step_ms"],
            "round_ms": result.get("round_ms", []), "peak_bytes": result.get("peak_bytes"),
            "dtype": "fp32" if result["precision"] == "fp32" else "bf16",
            "loss": result["train_loss"], "mfu": True,
            "compile_s": (result.get("compile") or {}).get("compile_s_rounds")
            or ([result["compile"]["compile_s"]] if result.get("compile") else None)}


def workload_table(workload, settings, rows, peaks):
    """The markdown of one workload's table: step, rounds, throughput, ratio to the first row
    (ampx fp32), peak memory, MFU against `peaks` (fp32 / bf16 GFLOP/s), compile time where a
    row was compiled, final train loss. settings: ampx-train's (batch, steps, lr)."""
    lines = []
    w = lines.append
    unit = UNITS[workload]
    flops = FLOPS[workload](settings["batch_size"])
    # per step: tokens for gpt (block 128), images otherwise
    items = settings["batch_size"] * (128 if workload in GPT_WORKLOADS else 1)
    slow_bf16 = peaks.get("bf16") and peaks.get("fp32") and peaks["bf16"] < peaks["fp32"]
    w(f"Batch {settings['batch_size']}, {settings['steps']} steps, AdamW lr {settings['lr']}, "
      f"median over the steps after warm-up; {flops / 1e9:.2f} GFLOP of matrix products per step "
      "(forward + backward). MFU: achieved matrix-product FLOP/s over the measured peak of the "
      "row's compute dtype. Peak MiB: the CPU allocator's most live bytes from the model's "
      "construction on (ampx: its tracking allocator; Python: the profiler's memory events over "
      "its first two steps, the same allocations; \"-\" where Debian's torch 1.13 records none)."
      + (" Here LibTorch's bf16 products run slower than its fp32 ones (the peaks above: a "
         "scalar loop without AVX-512, oneDNN's AVX512-BF16 kernels on a Xeon without AMX), so "
         "a bf16 row's MFU is against that slow peak and exceeds 100% where ampx multiplies bf16 "
         "in the fp32 BLAS (\"What each side ran\" says where each side's bf16 products went)."
         if slow_bf16 else ""))
    w("")
    compiled = any(r.get("compile_s") for r in rows)
    w(f"| run | median step ms | rounds ms | {unit} | vs ampx fp32 | peak MiB | vs fp32 | MFU | "
      + ("compile s | " if compiled else "") + "final train loss |")
    w("| --- |" + " ---: |" * (8 + compiled))
    spread = lambda r: (f"{min(r['round_ms']):.1f}–{max(r['round_ms']):.1f}"
                        if len(r.get("round_ms") or []) > 1 else "-")
    base = rows[0]
    for r in rows:
        ms = r["ms"]
        peak = peaks.get(r["dtype"]) if r["mfu"] else None
        mfu = flops / (ms / 1e3) / (peak * 1e9) if peak else None
        mem = (f"{r['peak_bytes'] / 2**20:.1f} | {r['peak_bytes'] / base['peak_bytes']:.2f}x"
               if r["peak_bytes"] and base.get("peak_bytes") else "- | -")
        comp = ""
        if compiled:
            cs = r.get("compile_s")
            comp = ("–".join(f"{x:.0f}" for x in (cs[0], cs[-1])) if cs and len(cs) > 1
                    else f"{cs[0]:.0f}" if cs else "-") + " | "
        w(f"| {r['label']} | {fmt(ms)} | {spread(r)} | {fmt(items / (ms / 1e3), 0)} | "
          f"{base['ms'] / ms:.2f}x | {mem} | {'-' if mfu is None else fmt(100 * mfu) + '%'} | "
          f"{comp}{r['loss']:.4f} |")
    w("")
    return lines
