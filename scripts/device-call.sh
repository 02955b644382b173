#!/usr/bin/env bash
# The whole GPU proof in one device call, each part bounded by a deadline so
# that its results come back inside the call (the device tool lends 15
# minutes a session, at most 10 a command; a fresh machine starts bare):
#
#   scripts/device-call.sh --prepare    here: fills .device/ (GoogleTest,
#                                       nlohmann/json, CLI11 and Gloo headers
#                                       from Debian's packages, Moby Dick)
#   scripts/device-call.sh OUT SECONDS  there (run with carry [".device"]), in
#                                       this order, each part bounded so that
#                                       the ones after it keep their time:
#     build   scripts/device-run.sh --part build
#     focus   the CUDA and NCCL tests and those that write files (the four
#             fixes of the first GPU run), straight from the gtest binary:
#             OUT/r/focus-tests.xml
#     bench   --part bench, 1 round of 30 steps (GPU peaks, fused AdamW, FP8
#             and its profile, ampx-train against torch.autocast)
#     test    --part test, every test; none started after the deadline less
#             a minute (STOP_AT)
#     cpu     --part cpu, gpt, 1 round of 8 steps, all cores then 2 threads,
#             with what is left (CPU_PARTS=0: not at all)
#   into OUT/r, then OUT/r.tgz (the tool returns at most 8 files)
#
# Seen on the H100 machine (16 cores): 2026-11-26, configure and build 200 s,
# tests 204 s (126 of them failing at once), GPU benchmarks and GPT-2 small
# 30-step runs ~100 s; 2026-11-28 (SECONDS 578, timeout_s 600), the build
# (make) ran out of its 243 s before ampx_train_tests was linked, focus tests
# 10 s, bench 105 s, tests stopped at their deadline after 164 s, CPU part
# (16 threads) 40 s. The build now has 280 s, with Ninja where it exists.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --prepare ]; then
  set -e
  rm -rf .device/googletest .device/nlohmann_include .device/cli11_include .device/gloo_include
  mkdir -p .device/nlohmann_include .device/cli11_include .device/gloo_include
  cp -r /usr/src/googletest .device/googletest
  cp -r /usr/include/nlohmann .device/nlohmann_include/
  cp -r /usr/include/CLI .device/cli11_include/
  cp -r /usr/include/gloo .device/gloo_include/
  scripts/install-data.sh .device/data --only moby-dick
  du -sh .device
  exit 0
fi
[ $# -eq 2 ] || { sed -n '6,23p' "$0" >&2; exit 2; }
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
# The GPU tests, and the tests that write files, first: cheap, and what the
# fixes of the first GPU run need checked.
focus='*Cuda*:*CUDA*:*Nccl*:*NCCL*:*Checkpoint*:*Safetensors*:*Archive*:*Serializ*'
timeout $(($(left) - 300)) scripts/device-run.sh "$r" --part build
if [ -x build/device/apps/ampx-train/ampx-train ]; then
  (cd build/device/tests && timeout 90 ./ampx_tests --gtest_filter="$focus" \
    --gtest_output="xml:$r/focus-tests.xml") > "$r/focus-tests.log" 2>&1
  status=$?
  echo "device-call: focus tests: exit $status" | tee -a "$r/device-run.log"
  timeout $(($(left) - 200)) scripts/device-run.sh "$r" --part bench --build build/device --rounds 1 --steps 30
  STOP_AT=$(date -d "@$((deadline - 60))" +%H:%M:%S) \
    timeout $(($(left) - 45)) scripts/device-run.sh "$r" --part test --build build/device
  if [ "${CPU_PARTS:-1}" = 1 ] && [ "$(left)" -gt 40 ]; then
    CPU_WORKLOADS=gpt timeout $(($(left) - 8)) scripts/device-run.sh "$r" --part cpu \
      --build build/device --rounds 1 --steps 8 --threads "$(nproc) 2"
  fi
fi
python3 scripts/device_report.py "$r" > "$r/summary.md" 2>&1
tar czf "$out/r.tgz" -C "$out" r
cp "$r/summary.md" "$r/device-run.log" "$out/" 2>/dev/null
tail -n 5 "$r/build.log" 2>/dev/null
cat "$r/device-run.log" "$r/summary.md"
