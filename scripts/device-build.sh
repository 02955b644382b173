#!/usr/bin/env bash
# Builds ampx against the machine's own PyTorch (pip wheel, CUDA): the one
# recipe of a build on the lent GPU machine, for scripts/device-run.sh
# (--part build) and scripts/device-test.sh.
#
#   scripts/device-build.sh BUILD LOG_DIR [CMAKE_ARGS...]
#
# cmake against torch.utils.cmake_prefix_path of $PYTHON (default python3),
# the unity build, Ninja where the machine has it; NCCL required
# (AMPX_NCCL=OFF in the environment to go without); sources of GoogleTest,
# nlohmann/json and CLI11, and Gloo's headers where the wheel lacks them,
# from .device/ (scripts/device-call.sh --prepare fills it from this
# machine's Debian packages). CMAKE_ARGS add to the configure (e.g.
# -DAMPX_BUILD_BENCHMARKS=OFF). LOG_DIR gets configure.log and build.log;
# stdout a line for each step.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '6p' "$0" >&2; exit 2; }
build=$1 logs=$2
shift 2
cd "$(dirname "$0")/.."
root=$PWD
mkdir -p "$logs"
PY=${PYTHON:-python3}
prefix=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
echo "configure against $("$PY" -c 'import torch; print(torch.__version__)') ($prefix)"
# Where the wheel lacks Gloo's headers (c10d's are there): Debian's, from .device/.
gloo=()
torch_include=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
if [ ! -e "$torch_include/gloo/context.h" ] && [ -e "$root/.device/gloo_include/gloo/context.h" ]; then
  gloo=(-DAMPX_GLOO_INCLUDE_DIR="$root/.device/gloo_include")
fi
generator=()  # Ninja where the machine has it: it keeps 16 cores busier than make
command -v ninja > /dev/null && generator=(-G Ninja)
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DAMPX_PYTHON="$(command -v "$PY")" -DAMPX_BUILD_BENCHMARKS=ON -DCMAKE_UNITY_BUILD=ON \
  -DAMPX_NCCL="${AMPX_NCCL:-ON}" \
  -DAMPX_GTEST_SOURCE_DIR="$root/.device/googletest" \
  -DAMPX_JSON_INCLUDE_DIR="$root/.device/nlohmann_include" \
  -DAMPX_CLI11_INCLUDE_DIR="$root/.device/cli11_include" "${gloo[@]}" "$@" > "$logs/configure.log" 2>&1 \
  || { cat "$logs/configure.log"; exit 1; }
start=$(date +%s)
cmake --build "$build" -j"$(nproc)" > "$logs/build.log" 2>&1 || { tail -50 "$logs/build.log"; exit 1; }
echo "built in $(($(date +%s) - start)) s"
