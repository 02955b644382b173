#!/bin/bash
# Every simulated run of docs/studies/fp8-second-moments.md, one at a time,
# one thread each, into $OUT (default runs/fp8-moments/sim); resumable.
set -e
here=$(cd "$(dirname "$0")" && pwd)
PY=$("$here/../../../scripts/wheel-env.sh" --python)
OUT=${OUT:-runs/fp8-moments/sim}
mkdir -p "$OUT"
for spec in "fp32 1" "fp8 1" "torchao-fp8 1" "fp8-sqrtv 1" "fp8-e5m2v 1" "fp8-v-only 1" "fp32 2" "fp8 2" "fp8-sqrtv 2" "fp32 3" "fp8 3" "fp8-sqrtv 3" "torchao-fp8 2" "torchao-fp8 3" "fp8-vfloor 1" "fp8-vfloor 2" "fp8-vfloor 3" "fp8-e5m2v 2" "fp8-e5m2v 3"; do
  set -- $spec
  out=$OUT/$1-seed$2.json
  [ -f $out ] && continue
  echo "=== $1 seed $2 $(date +%T)"
  PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=1 $PY "$here/sim_mnist.py" --codec $1 --seed $2 --json $out 2>&1 | grep -v "^step "
done
echo "=== done $(date +%T)"
