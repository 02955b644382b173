#!/usr/bin/env bash
# The GPU command's rehearsal on the CPU (ctest device_run.rehearsal):
# scripts/device-run.sh --part bench --quick, then --part cpu --quick, on
# this build, with a small generated text as the gpt's data. Without a CUDA
# device every GPU part must say it was skipped, and the runs of ampx-train
# and Python (bench's, and the CPU comparison's on gpt and gpt-nn) must have
# produced results that the summary holds.
#   tests/helpers/device_run_rehearsal.sh BUILD_DIR OUT_DIR PYTHON
set -euo pipefail
build=$1 out=$2 py=$3
src=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$out"
mkdir -p "$out/data/moby-dick"
"$py" -c 'import random; r = random.Random(1); print("".join(r.choice("abcdefgh ijklmnop\n") for _ in range(20000)))' \
  > "$out/data/moby-dick/data.txt"
status=0
AMPX_DATA_DIR="$out/data" PYTHON="$py" "$src/scripts/device-run.sh" "$out/run" --part bench \
  --build "$build" --quick || status=$?
AMPX_DATA_DIR="$out/data" PYTHON="$py" "$src/scripts/device-run.sh" "$out/run" --part cpu \
  --build "$build" --quick || status=$?
cat "$out/run/summary.md"
"$py" - "$out/run/summary.json" "$status" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
status = int(sys.argv[2])
problems = []
t = s.get("training", {})
for mode in ("fp32", "O1"):
    if not (t.get("ampx", {}).get(mode, {}).get("items_per_s") or 0) > 0:
        problems.append(f"no ampx-train {mode} result")
for p in ("fp32", "autocast-bf16"):
    if not (t.get("python", {}).get(p, {}).get("items_per_s") or 0) > 0:
        problems.append(f"no Python {p} result")
cpu = s.get("cpu", {})
for workload in ("gpt", "gpt-nn"):
    runs = cpu.get(f"cpu-t1/{workload}", {})
    for mode in ("fp32", "O1", "O2"):
        if not (runs.get("ampx", {}).get(mode, {}).get("items_per_s") or 0) > 0:
            problems.append(f"no CPU comparison ampx-train {workload} {mode} result")
    for p in ("fp32", "autocast-bf16"):
        if not (runs.get("python", {}).get(p, {}).get("items_per_s") or 0) > 0:
            problems.append(f"no CPU comparison Python {workload} {p} result")
if s.get("gpu") is None and not any("ampx_gpu_bench: skipped (no CUDA device)" in x
                                    for x in s.get("skipped", [])):
    problems.append("the GPU benchmark is not reported as skipped")
if status != 0:
    problems.append(f"device-run.sh exited {status}")
for p in problems:
    print("device_run.rehearsal:", p)
sys.exit(1 if problems else 0)
PY
