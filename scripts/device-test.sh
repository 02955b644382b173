#!/usr/bin/env bash
# Builds ampx against the machine's own PyTorch (pip wheel, CUDA) and runs the
# tests there; for the lent GPU machine, which has no Debian packages. The
# build is scripts/device-build.sh's (in build/device, without the
# benchmarks; its logs in build/device-logs); arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/device-build.sh build/device build/device-logs -DAMPX_BUILD_BENCHMARKS=OFF
cd build/device && ctest --output-on-failure -j8 "$@"
