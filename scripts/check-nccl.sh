#!/usr/bin/env bash
# Compiles ampx::dist with its NCCL code switched on (AMPX_WITH_NCCL), against
# LibTorch 1.13's headers (Debian 12, this machine) and 2.6's (the Debian 13
# chroot of scripts/trixie.sh), with a CUDA toolkit's headers for nccl.h and
# cuda_runtime_api.h. Syntax and types only: Debian's LibTorch has no CUDA
# libraries to link against, so this is what keeps the NCCL code compiling
# on machines without a GPU; scripts/device-test.sh builds and runs it for
# real on the GPU machine.
#
#   scripts/check-nccl.sh            # CUDA headers from $CUDA_HOME or /usr/local/cuda
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA=${CUDA_HOME:-/usr/local/cuda}
if [ ! -f "$CUDA/include/nccl.h" ] || [ ! -f "$CUDA/include/cuda_runtime_api.h" ]; then
  echo "check-nccl: no CUDA toolkit with NCCL headers at $CUDA (set CUDA_HOME)" >&2
  exit 2
fi
stub=$(mktemp -d)
trap 'rm -rf "$stub"' EXIT
# Generated only by CUDA builds of LibTorch; empty is what a shared build needs here.
mkdir -p "$stub/gen/c10/cuda/impl"
echo '#pragma once' >"$stub/gen/c10/cuda/impl/cuda_cmake_macros.h"
defs=(-DAMPX_WITH_DIST -DUSE_C10D_GLOO -DUSE_DISTRIBUTED -DAMPX_WITH_NCCL -DUSE_C10D_NCCL)  # as CMakeLists.txt does

check() {  # label, include flags...
  local label=$1
  shift
  for f in src/dist/*.cpp; do
    g++ -std=c++17 -fsyntax-only -w "${defs[@]}" -Iinclude -Isrc/dist -I"$stub/gen" "$@" \
      -I"$CUDA/include" "$f"
  done
  echo "check-nccl: src/dist compiles with NCCL against LibTorch $label"
}

check "1.13 (/usr/include)" -I/usr/include/torch/csrc/api/include

ROOT=${AMPX_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/ampx}/trixie-root  # as scripts/trixie.sh
if [ -d "$ROOT/usr/include/torch" ]; then
  # Its LibTorch and Gloo headers only: its C library's would not fit this compiler.
  mkdir -p "$stub/t26"
  for d in torch ATen c10 caffe2 gloo; do
    [ -e "$ROOT/usr/include/$d" ] && ln -s "$ROOT/usr/include/$d" "$stub/t26/$d"
  done
  check "2.6 ($ROOT)" -I"$stub/t26" -I"$stub/t26/torch/csrc/api/include"
else
  echo "check-nccl: no Debian 13 chroot at $ROOT (scripts/trixie.sh makes it); 2.6 not checked"
fi
