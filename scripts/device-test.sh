#!/usr/bin/env bash
# Builds ampx against the machine's own PyTorch (pip wheel, CUDA) and runs the
# tests there; for the lent GPU machine, which has no Debian packages. Expects
# GoogleTest sources and nlohmann/json.hpp in .device/ (copied from this
# machine's googletest and nlohmann-json3-dev packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
prefix=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
build=build/device
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DAMPX_PYTHON="$(command -v "$PY")" -DAMPX_BUILD_BENCHMARKS=OFF \
  -DAMPX_GTEST_SOURCE_DIR="$PWD/.device/googletest" \
  -DAMPX_JSON_INCLUDE_DIR="$PWD/.device/nlohmann_include" >/dev/null
cmake --build "$build" -j"$(nproc)"
cd "$build" && ctest --output-on-failure -j8 "$@"
