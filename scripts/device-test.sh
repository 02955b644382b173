#!/usr/bin/env bash
# Builds ampx against the machine's own PyTorch (pip wheel, CUDA) and runs the
# tests there; for the lent GPU machine, which has no Debian packages. NCCL
# is required (AMPX_NCCL=ON: a missing nccl.h fails the configure instead of
# skipping the NCCL tests; AMPX_NCCL=OFF in the environment to go without). Expects
# GoogleTest sources, nlohmann/json.hpp and CLI11's headers in .device/
# (scripts/device-call.sh --prepare copies them from this machine's Debian
# packages; scripts/device-run.sh also uses the Gloo headers it copies).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
prefix=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
build=build/device
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DAMPX_PYTHON="$(command -v "$PY")" -DAMPX_BUILD_BENCHMARKS=OFF \
  -DAMPX_NCCL="${AMPX_NCCL:-ON}" \
  -DAMPX_GTEST_SOURCE_DIR="$PWD/.device/googletest" \
  -DAMPX_JSON_INCLUDE_DIR="$PWD/.device/nlohmann_include" \
  -DAMPX_CLI11_INCLUDE_DIR="$PWD/.device/cli11_include" >/dev/null
cmake --build "$build" -j"$(nproc)"
cd "$build" && ctest --output-on-failure -j8 "$@"
