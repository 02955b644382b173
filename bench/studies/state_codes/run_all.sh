#!/bin/bash
# Every simulated run of docs/studies/8bit-state-codes.md, one at a time, one thread each, into
# $OUT (default runs/state-codes); resumable (a finished run's JSON is kept).
set -e
here=$(cd "$(dirname "$0")" && pwd)
PY=$("$here/../../../scripts/wheel-env.sh" --python)
OUT=${OUT:-runs/state-codes}
mkdir -p "$OUT"
runs=()
for seed in 1 2 3; do for code in fp32 dynamic dynamic-floor linear linear0; do runs+=("mnist-cnn $code $seed"); done; done
for code in fp32 dynamic linear dynamic-floor linear0; do runs+=("gpt $code 1"); done
for spec in "${runs[@]}"; do
  set -- $spec
  out=$OUT/$1-$2-seed$3.json
  [ -f "$out" ] && continue
  echo "=== $1 $2 seed $3 $(date +%T)"
  PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=1 $PY "$here/sim_codes.py" --workload $1 --code $2 \
    --seed $3 --json "$out.partial" 2>&1 | grep -v "Warning\|register_constant" | tail -1
  mv "$out.partial" "$out"
done
echo "=== done $(date +%T)"
