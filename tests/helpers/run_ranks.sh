#!/usr/bin/env bash
# Starts N copies of PROGRAM as ranks 0..N-1 of one run on loopback, with the
# variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
# MASTER_ADDR, MASTER_PORT), and exits with the first non-zero status, or 0.
#
#   tests/helpers/run_ranks.sh 2 ./build/host/examples/ddp_torchrun --steps 60
set -u
n=$1
shift
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null ||
       shuf -i 20000-60000 -n 1)
pids=()
for ((r = 0; r < n; r++)); do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=$n LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || { code=$?; [ "$status" -eq 0 ] && status=$code; }
done
exit "$status"
