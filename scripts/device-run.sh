#!/usr/bin/env bash
# The GPU proof of ampx in one command, for the lent GPU machine (PyTorch from
# pip with CUDA, nvcc, no Debian packages, no network):
#
#   scripts/device-run.sh OUT [--part all|build|test|bench|cpu] [--build DIR] [--quick]
#                             [--rounds N] [--steps N] [--threads "2 16"]
#
#   build  scripts/device-build.sh (cmake against the machine's PyTorch, tests
#          and the JSON benchmarks on, NCCL required: AMPX_NCCL=OFF in the
#          environment to go without): OUT/configure.log, OUT/build.log
#   test   every test, the CUDA ones included: OUT/tests.log, OUT/ctest-junit.xml
#          (none started after $STOP_AT, a time of day, where it is set)
#   bench  interleaved in rounds: ampx_gpu_bench (matrix-product peaks; ampx's
#          fused AdamW against PyTorch's _fused_adamw_ plus the bf16 copy and
#          against a copy), ampx_fp8_bench (on the GPU with its Kineto
#          profile, OUT/fp8-profile.json), then per round and mode (fp32; O1
#          and O2 in fp16 with GradScaler; O2 in bf16; fp8, O1 bf16 with FP8
#          Linears) ampx-train and the same
#          model in Python (torch.autocast + GradScaler + AdamW(fused=True)):
#          GPT-2 small's shape on Moby Dick
#   cpu    (not in all) the CPU comparison against the LibTorch of a pip wheel:
#          ampx-train built against the wheel and the wheel's Python
#          torch.autocast, gpt and gpt-nn ($CPU_WORKLOADS) on the CPU (bf16),
#          fp32/O1/O2 against fp32/autocast-bf16 (and torch.compile'd autocast
#          where CPU_COMPILE=1), interleaved, at each thread count of --threads
#          (default: 2 and all cores): OUT/cpu-tN/
#   then   scripts/device_report.py: OUT/summary.md (a section for
#          docs/performance/gpu.md) and OUT/summary.json, naming what was skipped
#
# Each part fits a device call of under 9 minutes on 16 cores (build+test in
# one, bench in the other). --build DIR uses an existing build as it is (no
# configure). Without a CUDA device (the rehearsal on the CPU, which `make
# test` runs with --quick) the same steps run: the GPU parts report
# themselves skipped, ampx-train and Python train a small gpt on the CPU.
# The datasets: $AMPX_DATA_DIR, else .device/data, else ~/.cache/ampx/data
# (the gpt workload needs moby-dick/).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

usage() {
  sed -n '4,5p' "$0" >&2
  exit 2
}
[ $# -ge 1 ] || usage
out=$1
shift
part=all build="" quick=0 rounds="" steps="" threads=""
while [ $# -gt 0 ]; do
  case $1 in
    --part) part=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --rounds) rounds=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    *) usage ;;
  esac
done
case $part in all|build|test|bench|cpu) ;; *) usage ;; esac
mkdir -p "$out"
out=$(cd "$out" && pwd)
touch "$out/device-run.log"  # appended to: parts may run as separate calls into one OUT
log() { echo "device-run: $*" | tee -a "$out/device-run.log"; }

PY=${PYTHON:-python3}
if [ -z "$build" ]; then
  build=build/device
  if [ "$part" = all ] || [ "$part" = build ]; then
    "$root/scripts/device-build.sh" "$build" "$out" | while read -r line; do log "$line"; done
  fi
fi
build=$(cd "$build" && pwd)
# The Python the build's tests use (the device machine's; Debian's in the rehearsal).
PY=$(sed -n 's/^AMPX_PYTHON:[A-Z]*=//p' "$build/CMakeCache.txt" | head -n 1)
PY=${PY:-python3}

run_json() {  # name command...: stdout to OUT/name.log; a failure is recorded, not fatal
  local name=$1
  shift
  if "$@" > "$out/$name.log" 2>&1; then
    log "$name: ok"
  else
    log "$name: FAILED (exit $?), see $name.log"
  fi
}
data=${AMPX_DATA_DIR:-}
[ -n "$data" ] || { [ -d .device/data ] && data=$root/.device/data; } || true
[ -n "$data" ] || data=${XDG_CACHE_HOME:-$HOME/.cache}/ampx/data

if [ "$part" = all ] || [ "$part" = test ]; then
  start=$(date +%s)
  status=0
  # STOP_AT (a time of day, HH:MM:SS): ctest starts no test after it and ends the running ones.
  (cd "$build" && ctest --output-on-failure -j"$(nproc)" --output-junit "$out/ctest-junit.xml" \
    ${STOP_AT:+--stop-time "$STOP_AT"}) \
    > "$out/tests.log" 2>&1 || status=$?
  log "tests: exit $status in $(($(date +%s) - start)) s ($(grep -E 'tests passed|tests failed' "$out/tests.log" | tail -n 1))"
fi

if [ "$part" = all ] || [ "$part" = bench ]; then
  cuda=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
  mkdir -p "$out/train"
  if [ "$quick" = 1 ]; then
    rounds=${rounds:-1} steps=${steps:-4}
  else
    rounds=${rounds:-2} steps=${steps:-60}
  fi
  if [ "$cuda" = 1 ]; then
    device=cuda shape=(--gpt-shape gpt2-small) pyshape=(--block-size 1024 --layers 12 --d-model 768 --heads 12)
    modes="fp32 O1 O2 O2-bf16 fp8-bf16" pyprecisions="fp32 autocast-fp16 autocast-bf16" half=fp16
  else
    device=cpu shape=(--layers 1 --d-model 32 --heads 2 --block-size 16) pyshape=(--layers 1 --d-model 32 --heads 2 --block-size 16)
    modes="fp32 O1" pyprecisions="fp32 autocast-bf16" half=bf16
  fi
  batch=(--batch-size "${BATCH:-$([ "$cuda" = 1 ] && echo 16 || echo 4)}")

  run_json gpu-bench "$build/bench/ampx_gpu_bench" --out "$out/gpu-bench.json" --iters "$([ "$quick" = 1 ] && echo 3 || echo 20)"
  if [ -x "$build/bench/ampx_fp8_bench" ]; then
    profile=""  # the Kineto trace, on the GPU (Debian's LibTorch has no Kineto)
    [ "$cuda" = 0 ] || profile="--profile '$out/fp8-profile.json'"
    run_json fp8-bench sh -c "'$build/bench/ampx_fp8_bench' --iters $([ "$quick" = 1 ] && echo 2 || echo 20) \
      $profile > '$out/fp8-bench.json'"
  fi
  for r in $(seq 1 "$rounds"); do
    for m in $modes; do  # a mode's dtype: bf16 where it says so, else $half (fp16: GradScaler)
      dtype=$half
      [ "${m%-bf16}" = "$m" ] || dtype=bf16
      run_json "train/ampx-$m-r$r" "$build/apps/ampx-train/ampx-train" --workload gpt --precision "${m%-bf16}" \
        --dtype "$dtype" --device "$device" "${shape[@]}" "${batch[@]}" --steps "$steps" \
        --data-dir "$data" --out-dir "$out/train/ampx-$m-r$r" --progress none
    done
    for p in $pyprecisions; do
      run_json "train/python-$p-r$r" "$PY" bench/python/torch_amp_bench.py --workload gpt \
        --precision "$p" --device "$device" "${pyshape[@]}" "${batch[@]}" --steps "$steps" \
        --data-dir "$data" --json "$out/train/python-$p-r$r.json" \
        $([ "$device" = cuda ] && echo --adamw-impl fused)
    done
  done
fi

if [ "$part" = cpu ]; then
  if [ "$quick" = 1 ]; then
    rounds=${rounds:-1} steps=${steps:-4} threads=${threads:-1}
    small=(--layers 1 --d-model 32 --heads 2 --block-size 16 --batch-size 4)
  else
    rounds=${rounds:-2} steps=${steps:-12} threads=${threads:-"2 $(nproc)"} small=()
  fi
  for t in $threads; do
    for r in $(seq 1 "$rounds"); do
      for w in ${CPU_WORKLOADS:-gpt gpt-nn}; do
        dir=cpu-t$t/$w
        mkdir -p "$out/$dir"
        for m in fp32 O1 O2; do
          run_json "$dir/ampx-$m-r$r" "$build/apps/ampx-train/ampx-train" --workload "$w" \
            --precision "$m" --dtype bf16 --device cpu --threads "$t" --steps "$steps" "${small[@]}" \
            --data-dir "$data" --out-dir "$out/$dir/ampx-$m-r$r" --progress none
        done
        for p in fp32 autocast-bf16 ${CPU_COMPILE:+autocast-bf16-compiled}; do
          run_json "$dir/python-$p-r$r" "$PY" bench/python/torch_amp_bench.py --workload "$w" \
            --precision "${p%-compiled}" $([ "${p%-compiled}" = "$p" ] || echo --compile) \
            --device cpu --threads "$t" --steps "$steps" "${small[@]}" \
            --data-dir "$data" --json "$out/$dir/python-$p-r$r.json"
        done
      done
    done
  done
fi

"$PY" scripts/device_report.py "$out" > "$out/summary.md"
log "summary: $out/summary.md"
# The exit status says whether everything that ran passed (the summary is
# written either way).
if grep -q "FAILED" "$out/device-run.log" || grep -qE "tests: exit [1-9]" "$out/device-run.log"; then
  exit 1
fi
