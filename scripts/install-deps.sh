#!/usr/bin/env bash
# Installs what ampx needs on a Debian 12 host (LibTorch 1.13 leg): compilers,
# CMake, LibTorch, an optimised BLAS, test and benchmark frameworks,
# Python's torch for reference values, Doxygen for the API reference, and
# Universal Ctags for the structure check (scripts/check-structure.py).
# Idempotent: packages already present are not fetched again.
set -euo pipefail

PACKAGES=(
  build-essential cmake make pkg-config
  libtorch-dev python3-torch python3-numpy python3-venv python3-dev
  libopenblas0-pthread libopenblas0-openmp libsleef-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  libcli11-dev nlohmann-json3-dev zlib1g-dev libgloo-dev
  gnuplot-nox dataset-fashion-mnist curl ca-certificates
  debootstrap doxygen universal-ctags
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
  else
    echo "ampx: missing Debian packages: ${missing[*]}" >&2
    echo "ampx: installing them needs root; run as root or install sudo." >&2
    exit 1
  fi
fi
echo "ampx: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
