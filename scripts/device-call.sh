#!/usr/bin/env bash
# The whole GPU proof in one device call, each part bounded by a deadline so
# that its results come back inside the call (the device tool lends 15
# minutes a session, at most 10 a command; a fresh machine starts bare):
#
#   scripts/device-call.sh --prepare    here: fills .device/ (GoogleTest,
#                                       nlohmann/json, CLI11 and Gloo headers
#                                       from Debian's packages, Moby Dick)
#   scripts/device-call.sh OUT SECONDS  there (run with carry [".device"]):
#                                       scripts/device-run.sh's parts build,
#                                       test, bench (1 round, 30 steps) and cpu
#                                       (1 round, 8 steps, 2 and 16 threads)
#                                       into OUT/r, then OUT/r.tgz (the tool
#                                       returns at most 8 files)
#
# Seen on the H100 machine (16 cores), 2026-11-26: configure and build 200 s,
# tests 204 s, GPU benchmarks and GPT-2 small 30-step runs ~100 s; a build of
# ampx-train alone needs more than 110 s. SECONDS 555 with timeout_s 600.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --prepare ]; then
  set -e
  rm -rf .device/googletest .device/nlohmann_include .device/cli11_include .device/gloo_include
  mkdir -p .device/cli11_include .device/gloo_include
  cp -r /usr/src/googletest .device/googletest
  cp -r /usr/include/nlohmann .device/nlohmann_include
  cp -r /usr/include/CLI .device/cli11_include/
  cp -r /usr/include/gloo .device/gloo_include/
  scripts/install-data.sh .device/data --only moby-dick
  du -sh .device
  exit 0
fi
[ $# -eq 2 ] || { sed -n '6,12p' "$0" >&2; exit 2; }
out=$1 budget=$2
r=$out/r
mkdir -p "$r"
deadline=$(($(date +%s) + budget))
left() { echo $((deadline - $(date +%s))); }
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "nccl", torch.cuda.nccl.version())'
  nvcc --version | tail -n 2; g++ --version | head -n 1; cmake --version | head -n 1; nproc
  lscpu | grep -E "Model name|^Flags"; free -g | head -n 2
  python3 -c 'import torch; print(torch.__config__.show())'
} > "$r/machine.txt" 2>&1
export AMPX_NCCL=AUTO
# Each part leaves the time the ones after it need.
timeout $(($(left) - 250)) scripts/device-run.sh "$r" --part build
if [ -x build/device/apps/ampx-train/ampx-train ]; then
  timeout $(($(left) - 110)) scripts/device-run.sh "$r" --part test --build build/device
  timeout $(($(left) - 35)) scripts/device-run.sh "$r" --part bench --build build/device --rounds 1 --steps 30
  timeout $(($(left) - 8)) scripts/device-run.sh "$r" --part cpu --build build/device --rounds 1 \
    --steps 8 --threads "2 $(nproc)"
fi
python3 scripts/device_report.py "$r" > "$r/summary.md" 2>&1
tar czf "$out/r.tgz" -C "$out" r
cp "$r/summary.md" "$r/device-run.log" "$out/" 2>/dev/null
tail -n 5 "$r/build.log" 2>/dev/null
cat "$r/device-run.log" "$r/summary.md"
