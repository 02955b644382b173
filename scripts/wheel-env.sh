#!/usr/bin/env bash
# PyTorch's own wheel (PyPI torch 2.15.0, the CUDA 13.2 build) in a virtual
# environment of Debian's Python, made once and reused, as the chroots are:
# the wheel leg of `make test` builds ampx against its LibTorch, and `make
# bench` runs its Python (eager and torch.compile) and torchao as the anchors.
#
#   scripts/wheel-env.sh --ensure     make or update the environment
#   scripts/wheel-env.sh --python     ensure, then print its Python's path
#   scripts/wheel-env.sh --bin        ensure, then print its bin/ (python, cmake, ctest)
#   scripts/wheel-env.sh --cmake-args ensure, then print the CMake arguments that
#                                     configure ampx against the wheel (one a line)
#   scripts/wheel-env.sh --lock       rewrite scripts/wheel-requirements.txt from
#                                     scripts/wheel-requirements.in (needs PyPI)
#
# What it holds: scripts/wheel-requirements.txt, every package pinned by
# version and sha256 (pip --require-hashes, wheels only): torch with NVIDIA's
# runtime wheels (cuBLAS, cuDNN, NCCL, ...), nvcc and the CUDA headers of the
# same CUDA release (cuda-toolkit[nvcc,cccl,curand]), torchao, safetensors,
# numpy. The Python is Debian 12's /usr/bin/python3 (3.11; python3-venv),
# not whatever python3 comes first on PATH. The environment lives in
#   ${AMPX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ampx}/wheel-venv
# (about 7 GB). Its stamp, written last, holds the sha256 of the
# requirements file: an environment without it (an interrupted install) or
# with another (changed pins) is made anew on the next use.
#
# The wheel's CUDA toolkit is spread over site-packages/nvidia/cu13 (nvcc,
# headers, libraries without their unversioned names). The environment gets
# a folder that CMake (FindCUDA, FindCUDAToolkit) and nvcc's own profile read
# as a toolkit, cuda/ beside the venv's bin/: bin/, include/ and nvvm/ linked
# from the wheels, lib/ (and lib64/, the same) with each library also under
# the unversioned name the link needs (libcudart.so, libcublas.so, ...).
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
REQ_IN=$SCRIPT_DIR/wheel-requirements.in
REQ=$SCRIPT_DIR/wheel-requirements.txt
CACHE_DIR=${AMPX_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/ampx}
VENV=$CACHE_DIR/wheel-venv
BASE_PYTHON=/usr/bin/python3
STAMP_NAME=.ampx-requirements-sha256

log() { echo "wheel-env: $*" >&2; }
die() { log "error: $*"; exit 1; }

usage() { sed -n '7,13p' "$0" >&2; exit 2; }
[ $# -eq 1 ] || usage
mode=$1
case $mode in --ensure|--python|--bin|--cmake-args|--lock) ;; *) usage ;; esac

need_base_python() {
  [ -x "$BASE_PYTHON" ] || die "$BASE_PYTHON not found (Debian package python3; scripts/install-deps.sh installs it)"
  "$BASE_PYTHON" -c 'import ensurepip, venv' 2>/dev/null ||
    die "$BASE_PYTHON cannot make virtual environments (Debian package python3-venv)"
}

# --lock: resolve wheel-requirements.in on PyPI in a scratch environment and
# write every package it pulls in with its version and the sha256 of the
# wheel that pip chose for this platform and Python.
if [ "$mode" = --lock ]; then
  need_base_python
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
  "$BASE_PYTHON" -m venv "$scratch/venv"
  "$scratch/venv/bin/pip" download --quiet --only-binary :all: -r "$REQ_IN" -d "$scratch/wheels"
  {
    echo "# Written by scripts/wheel-env.sh --lock from scripts/wheel-requirements.in on $(date -u +%F)"
    echo "# for CPython $("$BASE_PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])') on x86_64 Linux. Do not edit: change the .in file and rerun."
    for whl in "$scratch"/wheels/*.whl; do
      base=$(basename "$whl")
      name=${base%%-*} rest=${base#*-}
      version=${rest%%-*}
      echo "$(echo "$name" | tr '_' '-' | tr 'A-Z' 'a-z')==$version --hash=sha256:$(sha256sum "$whl" | cut -d' ' -f1)"
    done | sort
  } > "$REQ.tmp"
  mv "$REQ.tmp" "$REQ"
  log "wrote $REQ ($(grep -c -- --hash "$REQ") packages)"
  exit 0
fi

want=$(sha256sum "$REQ" | cut -d' ' -f1)

make_toolkit_dir() {  # VENV: the cuda/ folder FindCUDAToolkit reads
  local venv=$1 site cu lib name
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cu=$site/nvidia/cu13
  [ -x "$cu/bin/nvcc" ] || die "nvcc not found in $cu/bin (cuda-toolkit[nvcc] in $REQ_IN)"
  mkdir -p "$venv/cuda/lib"
  ln -sfn lib "$venv/cuda/lib64"
  ln -sfn "$cu/bin" "$venv/cuda/bin"
  ln -sfn "$cu/include" "$venv/cuda/include"
  ln -sfn "$cu/nvvm" "$venv/cuda/nvvm" 2>/dev/null || true
  # Each versioned library of the wheels under its unversioned name too
  # (libcudart.so.13 -> libcudart.so), as a toolkit's lib64 has them.
  for lib in "$site"/nvidia/*/lib/lib*.so.* "$cu"/lib/lib*.so.* "$cu"/lib/lib*.a; do
    [ -e "$lib" ] || continue
    name=$(basename "$lib")
    ln -sfn "$lib" "$venv/cuda/lib/$name"
    case $name in *.so.*) ln -sfn "$lib" "$venv/cuda/lib/${name%%.so.*}.so" ;; esac
  done
}

ensure_venv() {
  if [ -f "$VENV/$STAMP_NAME" ] && [ "$(cat "$VENV/$STAMP_NAME")" = "$want" ]; then
    return 0
  fi
  need_base_python
  mkdir -p "$CACHE_DIR"
  exec 8>"$VENV.lock"
  flock 8
  if [ -f "$VENV/$STAMP_NAME" ] && [ "$(cat "$VENV/$STAMP_NAME")" = "$want" ]; then
    return 0  # made by another run while this one waited
  fi
  rm -rf "$VENV"
  log "making $VENV from $REQ (PyTorch's wheel and NVIDIA's: about 3 GB to download, 7 GB unpacked)"
  "$BASE_PYTHON" -m venv "$VENV"
  # --no-deps: the requirements list every package (written by --lock), so
  # pip resolves nothing on its own; --require-hashes: each file is the one pinned.
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps --require-hashes \
    --only-binary :all: -r "$REQ" || die "pip install -r $REQ failed"
  make_toolkit_dir "$VENV"
  echo "$want" > "$VENV/$STAMP_NAME"
  log "ready: $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)')"
}

ensure_venv
case $mode in
  --ensure) ;;
  --python) echo "$VENV/bin/python" ;;
  --bin) echo "$VENV/bin" ;;
  --cmake-args)
    py=$VENV/bin/python
    torch_dir=$("$py" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
    echo "-DCMAKE_PREFIX_PATH=$torch_dir/share/cmake"
    # LibTorch's config looks for libtorch.so, libc10.so, ... in the system's
    # folders before its own: with Debian's libtorch-dev installed (the host
    # leg's) it would take those. Its own lib/ first.
    echo "-DCMAKE_LIBRARY_PATH=$torch_dir/lib"
    echo "-DAMPX_PYTHON=$py"
    echo "-DCUDA_TOOLKIT_ROOT_DIR=$VENV/cuda"
    echo "-DCMAKE_CUDA_COMPILER=$VENV/cuda/bin/nvcc"
    # Without a GPU to detect, LibTorch's config compiles for its "Common"
    # list, which falls back to compute_50, gone from CUDA 13 (sm_75 and up):
    # Hopper's 9.0 instead, the GPU machines' H100 and H200.
    echo "-DTORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}"
    ;;
esac
