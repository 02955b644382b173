"""ampx's FP8 Linear against torchao's, both emulated on the CPU (issue 39: torchao 0.18's
Float8Linear as the FP8 anchor): what run_all.py runs for its part 'fp8', and that part of the
report.

Once per round, ampx then torchao, with the same tokens, iterations, warm-up and threads, on
the matrix shapes of a GPT-2-small block (qkv, proj, fc, out), one forward and backward per
iteration, each program taking the median of its iterations:
  - ampx_fp8_bench built against the wheel's LibTorch (--wheel-build; bench/cpp/fp8_bench.cpp):
    torch::nn::Linear under ampx's bf16 autocast, and the same layer converted by
    ampx::fp8::convert_linears in an Fp8AutocastGuard region;
  - the wheel's Python (--wheel-python) on bench/python/torchao_fp8_bench.py: nn.Linear under
    torch.autocast bf16, and torchao's Float8Linear (tensorwise, emulate=True).
A shape's time is the median of its rounds'. Neither side has FP8 products on the CPU: both
multiply the FP8 values in float32, so an fp8 time is the emulation's cost, not FP8's speed
(each program counts its _scaled_mm calls). ampx_fp8_bench has no --threads flag: its
LibTorch takes OpenMP's thread count, OMP_NUM_THREADS.

Only the standard library: the orchestration runs under any python3.

    fp8.add_args(parser)                 # --fp8-tokens, --fp8-iters
    fp8.check_args(args, parser)         # sizes resolved, the wheel build's program checked
    data["fp8"] = fp8.measure(args, out)
    lines += fp8.report(data["fp8"])
"""
import json
import os
import statistics

import wheel
from harness import fmt, log, run

PART = "fp8"  # its name in run_all.py --only
SIDES = ("ampx", "torchao")
MODES = ("bf16", "fp8")
TARGET = "ampx_fp8_bench"  # the CMake target, and the program in <wheel-build>/bench
TORCHAO_SCRIPT = os.path.join("bench", "python", "torchao_fp8_bench.py")  # from the repo root
# ampx_fp8_bench's warm-up iterations (fixed in bench/cpp/fp8_bench.cpp): torchao's side is given
# the same.
WARMUP = 3
# (flag's dest, default, --quick's): tokens are ampx_fp8_bench's CPU default; the wheel's bf16
# products are LibTorch's scalar loop on a CPU without AVX512-BF16, seconds per iteration.
SIZES = (("fp8_tokens", 512, 128), ("fp8_iters", 10, 2))


def add_args(parser):
    parser.add_argument("--fp8-tokens", type=int, default=None,
                        help="rows of each layer's input on both sides of part 'fp8' "
                             "[default: 512; --quick 128]")
    parser.add_argument("--fp8-iters", type=int, default=None,
                        help="timed iterations of each program in part 'fp8' [default: 10; "
                             "--quick 2]")


def exe_of(build):
    return os.path.join(build, "bench", TARGET)


def check_args(args, parser):
    """The part's sizes (--quick's where no flag gave one) and, when the part runs, its program
    in the wheel build, named with the target to build where it is missing."""
    for name, full, quick in SIZES:
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if PART not in args.only.split(",") or not wheel.enabled(args):
        return
    exe = exe_of(args.wheel_build)
    if not os.path.exists(exe):
        parser.error(f"--wheel-build {args.wheel_build}: no {exe} (build the target {TARGET} "
                     f"there, or leave '{PART}' out of --only)")


def commands(args):
    """{side: (command, extra environment)}, the same sizes on both sides."""
    sizes = ["--tokens", str(args.fp8_tokens), "--iters", str(args.fp8_iters)]
    return {"ampx": ([exe_of(args.wheel_build), "--device", "cpu"] + sizes,
                     {"OMP_NUM_THREADS": str(args.threads)}),
            "torchao": ([args.wheel_python, TORCHAO_SCRIPT] + sizes +
                        ["--warmup", str(WARMUP), "--threads", str(args.threads)], {})}


def shown(cmd, env):
    return " ".join([f"{k}={v}" for k, v in env.items()] + cmd)


def measure(args, out):
    """performance.json's "fp8": both sides, round after round, each side's rounds combined; a
    side that fails is reported as failed (with the message), not fatal. None without the
    wheel: the part runs on the wheel's LibTorch and Python."""
    if not wheel.enabled(args):
        log(f"part '{PART}' needs --wheel-build and --wheel-python: skipped")
        return None
    os.makedirs(os.path.join(out, "fp8"), exist_ok=True)
    cmds = commands(args)
    rounds, failed = {side: [] for side in SIDES}, {}
    for rnd in range(args.rounds):
        for side in SIDES:
            if side in failed:
                continue
            cmd, env = cmds[side]
            try:
                text = run(cmd, env=dict(os.environ, **env))
            except SystemExit as e:
                failed[side] = str(e)
                continue
            result = json.loads(text.strip().splitlines()[-1])  # one JSON object, last line
            with open(os.path.join(out, "fp8", f"{side}-r{rnd}.json"), "w") as f:
                json.dump(result, f, indent=1)
            rounds[side].append(result)
    return {"tokens": args.fp8_tokens, "iters": args.fp8_iters, "warmup": WARMUP,
            "threads": args.threads, "rounds": args.rounds, "build": args.wheel_build,
            "python": args.wheel_python,
            "commands": {side: shown(*cmds[side]) for side in SIDES}, "failed": failed,
            **{side: combine(rounds[side]) for side in SIDES}}


def combine(rounds):
    """One side's rounds as one: each shape's bf16 and fp8 times the median of its rounds'
    (kept in bf16_round_ms, fp8_round_ms); versions from the first round, _scaled_mm calls
    summed over all. None where no round ran."""
    if not rounds:
        return None
    first = rounds[0]
    shapes = []
    for s in first["shapes"]:
        row = {k: s[k] for k in ("name", "in", "out") if k in s}
        for mode in MODES:
            ms = [next(x for x in r["shapes"] if x["name"] == s["name"])[mode + "_ms"]
                  for r in rounds]
            row[mode + "_ms"] = statistics.median(ms)
            row[mode + "_round_ms"] = ms
        shapes.append(row)
    return {"torch": first.get("torch"), "torchao": first.get("torchao"),
            "scaled_mm_calls": sum(r.get("scaled_mm_calls", 0) for r in rounds),
            "shapes": shapes}


# --------------------------------------------------------------------- report
def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


def table(result):
    """Per shape and for the block (the shapes summed): each side's bf16 and fp8 ms, its
    fp8 / bf16, and torchao's fp8 over ampx's."""
    by = {side: {s["name"]: s for s in (result[side] or {}).get("shapes", [])} for side in SIDES}
    names = list(by["ampx"]) + [n for n in by["torchao"] if n not in by["ampx"]]
    lines = ["| shape | in -> out | ampx bf16 ms | ampx fp8 ms | ampx fp8 / bf16 | "
             "torchao bf16 ms | torchao fp8 ms | torchao fp8 / bf16 | torchao fp8 / ampx fp8 |",
             "| --- | --- | " + " | ".join("---:" for _ in range(7)) + " |"]
    rows = [(n, {side: by[side].get(n, {}) for side in SIDES}) for n in names]
    if len(names) > 1:
        block = {side: {m + "_ms": sum(by[side][n][m + "_ms"] for n in names)
                        for m in MODES} if all(n in by[side] for n in names) else {}
                 for side in SIDES}
        rows.append(("block (sum)", block))
    for name, r in rows:
        a, t = r["ampx"], r["torchao"]
        dims = f"{t['in']} -> {t['out']}" if "in" in t else "-"
        lines.append(
            f"| {name} | {dims} | {fmt(a.get('bf16_ms'), 2)} | {fmt(a.get('fp8_ms'), 2)} | "
            f"{ratio(a.get('fp8_ms'), a.get('bf16_ms'))} | {fmt(t.get('bf16_ms'), 2)} | "
            f"{fmt(t.get('fp8_ms'), 2)} | {ratio(t.get('fp8_ms'), t.get('bf16_ms'))} | "
            f"{ratio(t.get('fp8_ms'), a.get('fp8_ms'))} |")
    return lines


def report(result):
    """The report's section: the table, its caption saying what ran where and how."""
    if not result:
        return []
    a, t = result["ampx"] or {}, result["torchao"] or {}
    calls = ", ".join(f"{side} {result[side]['scaled_mm_calls']}" for side in SIDES
                      if result[side])
    lines = ["## FP8 against torchao (the wheel's LibTorch; both emulated on the CPU)", ""]
    lines.append(
        "Both sides are emulations on the CPU: there is no FP8 hardware here, and both multiply "
        "the FP8 values in float32"
        + (f" (`_scaled_mm` calls counted: {calls})" if calls else "")
        + ", so an fp8 time is what FP8's numerics cost on the CPU, not FP8's speed. "
        f"ampx: `{TARGET}` built against torch {a.get('torch', '-')} (the wheel's LibTorch, "
        f"`{result['build']}`), `torch::nn::Linear` under ampx's bf16 autocast, and after "
        "`ampx::fp8::convert_linears` in an `Fp8AutocastGuard` region. torchao "
        f"{t.get('torchao', '-')} on torch {t.get('torch', '-')} (`{result['python']}`): "
        "`nn.Linear` under `torch.autocast` bf16, and `Float8Linear` with "
        "`Float8LinearConfig(emulate=True)` (tensorwise: dynamic per-tensor scales, E4M3 "
        f"forward, E5M2 gradients). One forward and backward per iteration, {result['tokens']} "
        f"tokens, {result['threads']} threads, the median of {result['iters']} iterations after "
        f"{result['warmup']} warm-up ones, then the median of {result['rounds']} rounds (ampx and "
        "torchao in turn). `fp8 / bf16` above 1: the FP8 emulation is slower than bf16; "
        "`torchao fp8 / ampx fp8` above 1: ampx's is faster. Commands: "
        + " and ".join(f"`{result['commands'][side]}`" for side in SIDES)
        + f" (`{TARGET}` has no `--threads`: its LibTorch takes OpenMP's).")
    lines.append("")
    lines += table(result)
    for side, why in result["failed"].items():
        lines.append(f"| {side}: failed, {why} | | | | | | | | |")
    lines.append("")
    return lines
