#!/usr/bin/env bash
# Runs a command inside a Debian chroot that holds another LibTorch than the
# Debian 12 host's 1.13, so that ampx is built and tested against it: one
# chroot per leg, made once and reused.
#
#   scripts/chroot.sh LEG <command...>   run <command> in the leg's chroot, cwd /src
#   scripts/chroot.sh LEG --ensure       only create / update the chroot
#   scripts/chroot.sh LEG --print-mirror print the mirrors and proxy it would use
#
# The legs:
#   forky  Debian testing ("forky"): LibTorch 2.14 (libtorch-dev) and its
#          python3-torch, GCC 16, C++20. Debian 12's debootstrap has no forky
#          script (sid's makes it), and forky's Release file on the mirror may
#          be past its Valid-Until date (apt is told not to check it).
#   cuda   Debian 13 ("trixie") with contrib and non-free: the CUDA build of
#          LibTorch 2.6 (libtorch-cuda-dev, python3-torch-cuda) and nvcc 12.4
#          (nvidia-cuda-toolkit) with g++-13 as its host compiler. Programs
#          link against libtorch_cuda and run on the CPU (no GPU here). Its
#          packages depend on nvidia-cudnn, an installer that downloads cuDNN
#          from the internet; they are unpacked (dpkg -x) instead of installed,
#          their dependencies from Debian installed by apt, and cuDNN's loader
#          library (libcudnn.so.9, which needs nothing but the C library) is
#          copied from the host's CUDA toolkit ($CUDA_HOME, /usr/local/cuda)
#          or, without one, from NVIDIA's cuDNN 9 wheel in the wheel leg's
#          environment (scripts/wheel-env.sh).
#
# A chroot lives outside the repository, in
#   ${AMPX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ampx}/<leg>-root
# and is reused. It is built in a temporary directory next to that path and
# renamed into place only once fully provisioned; a stamp file inside it
# (/.ampx-packages) lists the installed packages, and packages added to a
# leg's lists below are installed on the next use.
#
# The repository root is bind-mounted at /src; /proc, /sys and /dev are
# bind-mounted too, and the host's AMPX_DATA_DIR (the datasets of
# scripts/install-data.sh), when set, at the same path. All mounts are made in a private mount namespace, into
# which the script re-executes itself and which the command finally replaces
# (exec): the kernel drops the mounts when the command ends, however it ends,
# and they are never visible on the host. Without namespace support the
# mounts are made in the host namespace and removed by an EXIT trap. The
# environment is reset to a small, fixed set (HOME, PATH, LANG, TERM, CI,
# AMPX_*, a few build-parallelism variables). The exit status is the
# command's. Stdin is passed through; nothing is ever read from it otherwise.
#
# Needs root (debootstrap, mount, chroot), plus debootstrap, unshare and flock
# on the host. Environment:
#   AMPX_CACHE_DIR               where the chroots live (above)
#   AMPX_CHROOT_MIRROR           Debian mirror; default: the one the host's own
#                                apt uses (/etc/apt/sources.list, sources.list.d/
#                                *.list and deb822 *.sources), so that a local
#                                mirror or caching proxy serves the chroot too;
#                                else http://deb.debian.org/debian
#   AMPX_CHROOT_SECURITY_MIRROR  default: the host's security mirror when the
#                                host's mirror is used, else <mirror minus
#                                /debian>/debian-security
#   AMPX_CHROOT_NO_NS=1          mount in the current namespace instead of a
#                                private one (debugging)
#   AMPX_APT_ETC                 read apt sources from here, not /etc/apt (tests)
# The host's apt proxy (Acquire::http::Proxy), if any, is used by debootstrap
# and by apt in the chroot. `scripts/chroot.sh LEG --print-mirror` prints the
# mirrors and proxy it would use.
set -euo pipefail

readonly FALLBACK_MIRROR=http://deb.debian.org/debian

log() { printf 'ampx: %s\n' "$*" >&2; }
die() { printf 'ampx: error: %s\n' "$*" >&2; exit 1; }

usage() {
  cat >&2 <<'EOF'
usage: scripts/chroot.sh LEG <command> [args...]  run a command in the leg's chroot (cwd /src)
       scripts/chroot.sh LEG --ensure             create or update the chroot only
       scripts/chroot.sh LEG --print-mirror       print the mirrors and proxy it would use
LEG: forky (LibTorch 2.14, Debian testing) or cuda (LibTorch 2.6 with CUDA, Debian 13)
EOF
}

# ---------------------------------------------------------------- the legs
ORIG_ARGS=("$@")
LEG=${1:-}
case "$LEG" in
  -h|--help) usage; exit 0 ;;
  forky|cuda) shift ;;
  "") usage; exit 2 ;;
  *) usage; die "unknown leg '$LEG' (forky or cuda)" ;;
esac
# Per leg: the Debian suite and the debootstrap script that makes it, the
# archive components, whether the suite has -updates and -security archives,
# apt settings, the packages apt installs (PACKAGES) and those unpacked
# without their dependencies (UNPACK: dpkg -x, see the cuda leg above).
APT_CONF=""
UNPACK=()
case "$LEG" in
  forky)
    SUITE=forky; DEBOOTSTRAP_SCRIPT=sid; COMPONENTS=main; POINT_RELEASES=0
    TITLE="Debian testing (forky), LibTorch 2.14"
    # Testing's Release file is re-signed weekly; the mirror's copy may have
    # passed its Valid-Until date.
    APT_CONF='Acquire::Check-Valid-Until "false";'
    PACKAGES=(
      build-essential cmake make
      libtorch-dev python3-torch python3-numpy python3-safetensors
      libopenblas0-pthread libopenblas0-openmp libsleef-dev
      libgtest-dev libgmock-dev googletest libbenchmark-dev
      libcli11-dev nlohmann-json3-dev zlib1g-dev libgloo-dev
      gnuplot-nox ca-certificates iproute2
    )
    ;;
  cuda)
    SUITE=trixie; DEBOOTSTRAP_SCRIPT=trixie; COMPONENTS="main contrib non-free"; POINT_RELEASES=1
    TITLE="Debian 13 (trixie), LibTorch 2.6 with CUDA 12.4"
    PACKAGES=(
      build-essential g++-13 cmake make
      python3 python3-dev python3-numpy python3-filelock python3-fsspec python3-jinja2
      python3-networkx python3-packaging python3-psutil python3-sympy
      python3-typing-extensions python3-yaml python3-requests
      libopenblas0-pthread libsleef-dev libprotobuf-dev
      libgtest-dev libgmock-dev googletest libbenchmark-dev
      libcli11-dev nlohmann-json3-dev zlib1g-dev
      # LibTorch 2.6's CPU dependencies (those of libtorch-cuda-2.6 in main)
      libcpp-httplib0.18 libcpuinfo0 libdnnl3.6 libfmt10 libnuma1 libonnx1t64
      libprotobuf32t64 libpthreadpool0 libsleef3 libvulkan1 libxnnpack0.20241108
      libz3-4 libzstd1
      # its CUDA ones (non-free, contrib): runtime libraries, NCCL, Gloo and
      # TensorPipe built with CUDA, CUDA's C++ template libraries
      libcudart12 libcublas12 libcublaslt12 libcufft11 libcurand10 libcusolver11
      libcusparse12 libnvrtc12 libnvtoolsext1 libnvjitlink12 libnccl2 libnccl-dev
      libgloo-cuda-dev libtensorpipe-cuda-0 libthrust-dev libcub-dev libcu++-dev
      ca-certificates iproute2
    )
    # These depend on nvidia-cudnn (the LibTorch packages) or on NVIDIA's
    # driver (nvidia-cuda-dev): unpacked.
    UNPACK=(libtorch-cuda-2.6 libtorch-cuda-dev python3-torch-cuda
            nvidia-cuda-toolkit nvidia-cuda-dev libnvvm4 libnvrtc-builtins12.4)
    ;;
esac

# The host's apt sources as "URI SUITE COMPONENTS..." lines, one per suite of
# each enabled `deb` entry: one-line sources.list / *.list entries (options in
# [...] dropped) and deb822 *.sources stanzas (Types/URIs/Suites/Components,
# Enabled: no skipped).
apt_source_entries() {
  local etc=${AMPX_APT_ETC:-/etc/apt} f
  for f in "$etc/sources.list" "$etc"/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    sed -e 's/#.*//' -e 's/\[[^]]*\]//' "$f" |
      awk '$1 == "deb" && NF >= 4 { c = ""; for (i = 4; i <= NF; i++) c = c " " $i; print $2, $3 c }'
  done
  for f in "$etc"/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk '
      function flush(   i, j, nu, ns, u, s) {
        if (types ~ /(^| )deb( |$)/ && enabled !~ /^(no|false|0)$/) {
          nu = split(uris, u, " "); ns = split(suites, s, " ")
          for (i = 1; i <= nu; i++) for (j = 1; j <= ns; j++) print u[i], s[j], comps
        }
        types = uris = suites = comps = enabled = ""
      }
      /^[ \t]*#/ { next }
      /^[ \t]*$/ { flush(); next }
      /^[A-Za-z-]+:/ {
        key = tolower(substr($0, 1, index($0, ":") - 1)); val = substr($0, index($0, ":") + 1)
        gsub(/^[ \t]+|[ \t]+$/, "", val)
        if (key == "types") types = val; else if (key == "uris") uris = val
        else if (key == "suites") suites = val; else if (key == "components") comps = val
        else if (key == "enabled") enabled = tolower(val)
      }
      END { flush() }' "$f"
  done
}

# The host's Debian mirror: the URI of the first entry for the host's own
# release (suite = its codename, or <codename>-$1, e.g. $1 = security) with
# component main. Third-party repositories use other suites or components;
# a host that is not Debian has no Debian mirror. Prints nothing if none.
host_debian_mirror() {
  local suffix=${1:-} id="" codename="" want uri suite comps
  if [ -r /etc/os-release ]; then
    id=$(. /etc/os-release && echo "${ID:-}")
    codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  fi
  [ "$id" = debian ] && [ -n "$codename" ] || return 0
  want=$codename${suffix:+-$suffix}
  while read -r uri suite comps; do
    case "$uri" in http://*|https://*|ftp://*|file:/*) ;; *) continue ;; esac
    if [ "$suite" = "$want" ] && [[ " $comps " == *" main "* ]]; then
      echo "${uri%/}"
      return 0
    fi
  done < <(apt_source_entries)
}

# The host's apt proxy for http (empty if none).
host_apt_proxy() {
  command -v apt-config >/dev/null 2>&1 || return 0
  local proxy=""
  eval "$(apt-config shell proxy Acquire::http::Proxy 2>/dev/null)" || true
  case "$proxy" in DIRECT|false) ;; *) echo "$proxy" ;; esac
}

HOST_MIRROR=$(host_debian_mirror)
MIRROR=${AMPX_CHROOT_MIRROR:-${HOST_MIRROR:-$FALLBACK_MIRROR}}
MIRROR=${MIRROR%/}
# The host's security mirror goes with the host's mirror only.
HOST_SECURITY_MIRROR=""
if [ "$MIRROR" = "$HOST_MIRROR" ]; then HOST_SECURITY_MIRROR=$(host_debian_mirror security); fi
SECURITY_MIRROR=${AMPX_CHROOT_SECURITY_MIRROR:-${HOST_SECURITY_MIRROR:-${MIRROR%/debian}/debian-security}}
APT_PROXY=$(host_apt_proxy)
# Host variables passed into the chroot (besides AMPX_*).
KEEP_VARS=(CI TERM CMAKE_BUILD_PARALLEL_LEVEL CTEST_PARALLEL_LEVEL
           CTEST_OUTPUT_ON_FAILURE MAKEFLAGS OMP_NUM_THREADS)
STAMP_NAME=.ampx-packages

# ---------------------------------------------------------------- arguments
ENSURE_ONLY=0
case "${1:-}" in
  "") usage; exit 2 ;;
  -h|--help) usage; exit 0 ;;
  --ensure) [ $# -eq 1 ] || { usage; exit 2; }; ENSURE_ONLY=1 ;;
  --print-mirror)
    echo "mirror:   $MIRROR${AMPX_CHROOT_MIRROR:+ (AMPX_CHROOT_MIRROR)}"
    echo "security: $SECURITY_MIRROR"
    echo "proxy:    ${APT_PROXY:-none}"
    exit 0 ;;
  --) shift; [ $# -gt 0 ] || { usage; exit 2; } ;;
esac

# ---------------------------------------------------------------- host checks
if [ "$(id -u)" -ne 0 ]; then
  die "scripts/chroot.sh needs root (debootstrap, mount --bind and chroot); run it as root, e.g. 'sudo scripts/chroot.sh $LEG ...'"
fi
for tool in unshare flock chroot mount umount; do
  command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found on the host (Debian package util-linux / coreutils / mount)"
done

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
REPO=$(git -C "$SCRIPT_DIR" rev-parse --show-toplevel 2>/dev/null || true)
[ -n "$REPO" ] || REPO=$(cd "$SCRIPT_DIR/.." && pwd -P)

CACHE_DIR=${AMPX_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/ampx}
ROOT=$CACHE_DIR/$LEG-root

# Re-execute in a private mount namespace: every mount made below is then
# invisible to the host and disappears with this process, whatever happens to
# it. If namespaces are unavailable (or AMPX_CHROOT_NO_NS=1) we stay in the
# current namespace and rely on the cleanup trap (mounts are made rslave so
# unmounting never propagates back). AMPX_CHROOT_IN_NS carries the outer
# namespace's id: we are in our own namespace only if ours differs from it and
# from our parent's (where readable; unshare execs without forking). A valid
# marker never leads to another unshare, so we re-execute at most once.
MY_NS=$(readlink /proc/self/ns/mnt 2>/dev/null || true)
PARENT_NS=$(readlink "/proc/$PPID/ns/mnt" 2>/dev/null || true)
OUTER_NS=${AMPX_CHROOT_IN_NS:-}
unset AMPX_CHROOT_IN_NS
IN_NS=0
if [[ $OUTER_NS =~ ^mnt:\[[0-9]+\]$ && $MY_NS =~ ^mnt:\[[0-9]+\]$ ]]; then
  if [ "$OUTER_NS" != "$MY_NS" ] && [ "$PARENT_NS" != "$MY_NS" ]; then
    IN_NS=1
  else
    log "note: not in a private mount namespace; mounts are removed on exit"
  fi
elif [ "${AMPX_CHROOT_NO_NS:-0}" != 1 ] && [ -n "$MY_NS" ] &&
     unshare --mount --propagation private true 2>/dev/null; then
  export AMPX_CHROOT_IN_NS=$MY_NS
  exec unshare --mount --propagation private -- \
      "$BASH" "${BASH_SOURCE[0]}" "${ORIG_ARGS[@]}"
else
  log "note: not using a private mount namespace; mounts are removed on exit"
fi

# ---------------------------------------------------------------- mounts
MOUNTED=()      # mount points made by this process, in mount order
TMP_ROOT=""     # chroot under construction (removed on failure)

mount_chroot_fs() {   # $1 = chroot dir; mounts /proc /sys /dev (+ /src if $2)
  local r=$1 d
  for d in proc sys dev; do
    mkdir -p "$r/$d"
    mount --rbind "/$d" "$r/$d"
    MOUNTED+=("$r/$d")
    mount --make-rslave "$r/$d"
  done
  if [ "${2:-}" = src ]; then
    mkdir -p "$r/src"
    mount --bind "$REPO" "$r/src"
    MOUNTED+=("$r/src")
    # The datasets (make run): at the same path, so AMPX_DATA_DIR holds inside.
    if [ -n "${AMPX_DATA_DIR:-}" ] && [ -d "$AMPX_DATA_DIR" ]; then
      case "$AMPX_DATA_DIR" in /*) ;; *) die "AMPX_DATA_DIR must be an absolute path, got '$AMPX_DATA_DIR'" ;; esac
      mkdir -p "$r$AMPX_DATA_DIR"
      mount --bind "$AMPX_DATA_DIR" "$r$AMPX_DATA_DIR"
      MOUNTED+=("$r$AMPX_DATA_DIR")
    fi
  fi
}

unmount_all() {
  local i m
  for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
    m=${MOUNTED[i]}
    umount -R "$m" 2>/dev/null || umount -R -l "$m" 2>/dev/null ||
      log "warning: could not unmount $m"
  done
  MOUNTED=()
}

# True if anything is mounted at or below $1 (in this namespace).
has_mounts_below() {
  local p=$1 target _
  while read -r _ _ _ _ target _; do
    target=$(printf '%b' "$target")   # mountinfo escapes spaces as \040
    case "$target" in "$p"|"$p"/*) return 0 ;; esac
  done </proc/self/mountinfo
  return 1
}

# rm -rf that never crosses into mounted file systems (e.g. the repo at /src).
safe_rmtree() {
  local p=$1
  [ -e "$p" ] || return 0
  if has_mounts_below "$p"; then
    log "warning: not removing $p: something is still mounted below it"
    return 1
  fi
  rm -rf --one-file-system -- "$p"
}

# shellcheck disable=SC2317  # invoked from the EXIT trap
cleanup() {
  unmount_all
  if [ -n "$TMP_ROOT" ]; then
    safe_rmtree "$TMP_ROOT" || true
    rm -f "$TMP_ROOT.debootstrap.log"
    TMP_ROOT=""
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# Runs a command in chroot $1 with a clean environment.
in_chroot() {
  local r=$1; shift
  env -i HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    chroot "$r" "$@"
}

# Installs packages $2... into chroot $1 (idempotent). apt's output goes to
# /var/log/ampx-apt.log in the chroot (last run only) and is shown on failure.
apt_install() {
  local r=$1 log=$1/var/log/ampx-apt.log; shift
  cp -L /etc/resolv.conf "$r/etc/resolv.conf" 2>/dev/null || true
  if ! { in_chroot "$r" apt-get update &&
         in_chroot "$r" apt-get install -y --no-install-recommends \
           -o Dpkg::Use-Pty=0 "$@" &&
         in_chroot "$r" apt-get clean; } </dev/null >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    die "apt-get failed inside the chroot (full log: $log)"
  fi
}

# Unpacks packages $2... into chroot $1 without installing them (dpkg -x:
# no maintainer scripts, no dependencies, unknown to dpkg; see the cuda leg),
# then copies in cuDNN's loader library (a CUDA toolkit's or the wheel's). The
# .debs are downloaded into the chroot's /var/cache/ampx-debs and removed.
unpack_packages() {
  local r=$1 log=$1/var/log/ampx-unpack.log; shift
  local cuda=${CUDA_HOME:-/usr/local/cuda} cudnn
  cudnn=$(ls "$cuda"/lib64/libcudnn.so.9* "$cuda"/lib/libcudnn.so.9* 2>/dev/null | head -n 1 || true)
  if [ -z "$cudnn" ]; then
    # No CUDA toolkit on the host: NVIDIA's cuDNN 9 wheel, from the wheel
    # leg's environment (scripts/wheel-env.sh, pinned and hashed).
    "$REPO/scripts/wheel-env.sh" --ensure ||
      die "the $LEG leg needs cuDNN 9's libcudnn.so.9: none in a CUDA toolkit ($cuda; set CUDA_HOME) and scripts/wheel-env.sh failed"
    cudnn=$(ls "${CACHE_DIR}"/wheel-venv/lib/python3*/site-packages/nvidia/cudnn/lib/libcudnn.so.9 2>/dev/null | head -n 1 || true)
    [ -n "$cudnn" ] || die "the $LEG leg needs cuDNN 9's libcudnn.so.9: not found in $cuda or in the wheel environment"
  fi
  log "unpacking $*"
  # shellcheck disable=SC2016  # expanded in the chroot's shell
  if ! in_chroot "$r" /bin/sh -c '
      set -e
      mkdir -p /var/cache/ampx-debs && cd /var/cache/ampx-debs
      apt-get update
      apt-get download -o Dpkg::Use-Pty=0 "$@" 2>&1 | grep -v "^W: Download is performed unsandboxed" || true
      for p in "$@"; do
        deb=$(ls "${p}"_*.deb)
        dpkg-deb --fsys-tarfile "$deb" | tar -x -C / --keep-directory-symlink
      done
      cd / && rm -rf /var/cache/ampx-debs' sh "$@" </dev/null >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    die "unpacking failed inside the chroot (full log: $log)"
  fi
  cp -L "$cudnn" "$r/usr/lib/x86_64-linux-gnu/libcudnn.so.9"
  in_chroot "$r" ldconfig
}

# The stamp's names of unpacked packages (unpack:NAME).
unpack_stamp_names() { local p; for p in "$@"; do echo "unpack:$p"; done; }

write_stamp() {   # $1 = chroot dir, $2... = packages
  local r=$1; shift
  {
    echo "# ampx $TITLE chroot, made by scripts/chroot.sh $LEG; installed packages:"
    printf '%s\n' "$@" | sort -u
  } >"$r/$STAMP_NAME.new"
  mv -f "$r/$STAMP_NAME.new" "$r/$STAMP_NAME"
}

read_stamp() { grep -v '^#' "$1/$STAMP_NAME" 2>/dev/null || true; }

create_chroot() {
  command -v debootstrap >/dev/null 2>&1 ||
    die "debootstrap not found on the host; install it with 'apt-get install debootstrap'"
  [ -e /usr/share/debootstrap/scripts/$DEBOOTSTRAP_SCRIPT ] ||
    die "this debootstrap does not know '$DEBOOTSTRAP_SCRIPT'; upgrade debootstrap"
  log "creating the $TITLE chroot in $ROOT (one-time, a few minutes)"
  local start=$SECONDS
  TMP_ROOT=$(mktemp -d "$ROOT.tmp.XXXXXX")
  chmod 755 "$TMP_ROOT"
  log "debootstrap $SUITE from $MIRROR"
  local dblog=$TMP_ROOT.debootstrap.log
  if ! env ${APT_PROXY:+http_proxy="$APT_PROXY"} \
      debootstrap --variant=minbase "$SUITE" "$TMP_ROOT" "$MIRROR" \
        "/usr/share/debootstrap/scripts/$DEBOOTSTRAP_SCRIPT" \
      </dev/null >"$dblog" 2>&1; then
    tail -n 30 "$dblog" >&2 || true
    [ -f "$TMP_ROOT/debootstrap/debootstrap.log" ] &&
      tail -n 30 "$TMP_ROOT/debootstrap/debootstrap.log" >&2
    rm -f "$dblog"
    die "debootstrap failed"
  fi
  rm -f "$dblog"
  # No services may start inside the chroot.
  printf '#!/bin/sh\nexit 101\n' >"$TMP_ROOT/usr/sbin/policy-rc.d"
  chmod 755 "$TMP_ROOT/usr/sbin/policy-rc.d"
  {
    echo "deb $MIRROR $SUITE $COMPONENTS"
    if [ "$POINT_RELEASES" = 1 ]; then
      echo "deb $MIRROR $SUITE-updates $COMPONENTS"
      echo "deb $SECURITY_MIRROR $SUITE-security $COMPONENTS"
    fi
  } >"$TMP_ROOT/etc/apt/sources.list"
  if [ -n "$APT_CONF" ]; then
    printf '%s\n' "$APT_CONF" >"$TMP_ROOT/etc/apt/apt.conf.d/01ampx-leg"
  fi
  if [ -n "$APT_PROXY" ]; then
    printf 'Acquire::http::Proxy "%s";\n' "$APT_PROXY" >"$TMP_ROOT/etc/apt/apt.conf.d/01ampx-proxy"
  fi
  mount_chroot_fs "$TMP_ROOT"
  log "installing ${PACKAGES[*]}"
  apt_install "$TMP_ROOT" "${PACKAGES[@]}"
  if [ ${#UNPACK[@]} -gt 0 ]; then unpack_packages "$TMP_ROOT" "${UNPACK[@]}"; fi
  unmount_all
  write_stamp "$TMP_ROOT" "${PACKAGES[@]}" $(unpack_stamp_names "${UNPACK[@]}")
  sync -f "$TMP_ROOT" 2>/dev/null || true
  mv -T "$TMP_ROOT" "$ROOT"
  TMP_ROOT=""
  log "chroot ready ($(du -sh --one-file-system "$ROOT" | cut -f1), $((SECONDS - start)) s)"
}

# Prints the packages of PACKAGES and UNPACK (as unpack:NAME) not listed in
# the chroot's stamp.
missing_packages() {
  local have p
  have=$(read_stamp "$ROOT")
  for p in "${PACKAGES[@]}" $(unpack_stamp_names "${UNPACK[@]}"); do
    if ! grep -qxF -- "$p" <<<"$have"; then echo "$p"; fi
  done
}

# True if the chroot must be created or updated.
needs_work() {
  local stale
  for stale in "$ROOT".tmp.*; do
    if [ -e "$stale" ]; then return 0; fi
  done
  [ ! -f "$ROOT/$STAMP_NAME" ] || [ -n "$(missing_packages)" ]
}

update_chroot() {
  local have missing
  mapfile -t missing < <(missing_packages)
  if [ ${#missing[@]} -eq 0 ]; then return 0; fi
  have=$(read_stamp "$ROOT")
  local install=() unpack=() p
  for p in "${missing[@]}"; do
    case "$p" in unpack:*) unpack+=("${p#unpack:}") ;; *) install+=("$p") ;; esac
  done
  log "adding to the chroot: ${missing[*]}"
  mount_chroot_fs "$ROOT"
  if [ ${#install[@]} -gt 0 ]; then apt_install "$ROOT" "${install[@]}"; fi
  if [ ${#unpack[@]} -gt 0 ]; then unpack_packages "$ROOT" "${unpack[@]}"; fi
  unmount_all
  # shellcheck disable=SC2086
  write_stamp "$ROOT" $have "${missing[@]}"
}

# Creates or updates the chroot. Called with the lock held exclusively.
ensure_chroot() {
  local stale
  # Any temporary tree left now is from an interrupted run (its owner would
  # hold the lock).
  for stale in "$ROOT".tmp.*; do
    [ -e "$stale" ] || continue
    case "$stale" in *.debootstrap.log) rm -f "$stale"; continue ;; esac
    log "removing unfinished chroot $stale"
    safe_rmtree "$stale" || die "cannot remove $stale; remove it by hand"
  done
  if [ -e "$ROOT" ]; then
    [ -f "$ROOT/$STAMP_NAME" ] ||
      die "$ROOT exists but has no $STAMP_NAME stamp (not made by this script, or damaged); remove it and rerun"
    update_chroot
  else
    create_chroot
  fi
}

# ---------------------------------------------------------------- main
# Users of the chroot hold the lock shared; creating or updating it takes the
# lock exclusively (flock drops the shared lock before waiting, so two
# upgrading runs cannot deadlock).
mkdir -p "$CACHE_DIR"
exec 9>"$CACHE_DIR/$LEG-root.lock"
if ! flock -s -n 9; then
  log "waiting for another scripts/chroot.sh run to finish creating/updating the chroot"
  flock -s 9
fi
if needs_work; then
  if ! flock -x -n 9; then
    log "waiting for other scripts/chroot.sh runs to release the chroot"
    flock -x 9
  fi
  ensure_chroot
  flock -s 9
fi

if [ "$ENSURE_ONLY" -eq 1 ]; then exit 0; fi

ENV=(HOME=/root LANG=C.UTF-8
     PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)
for v in "${KEEP_VARS[@]}" $(compgen -e | grep '^AMPX_' || true); do
  case "$v" in AMPX_CACHE_DIR|AMPX_CHROOT_*) continue ;; esac
  if [ -n "${!v+x}" ]; then ENV+=("$v=${!v}"); fi
done

mount_chroot_fs "$ROOT" src
RUN=(env -i "${ENV[@]}" chroot "$ROOT" /bin/sh -c 'cd /src && exec "$@"' sh "$@")
if [ "$IN_NS" = 1 ]; then
  # The command replaces this process: signals reach it directly, its exit
  # status is ours, and the kernel drops the namespace and its mounts when it
  # (and anything it left running) exits. It inherits the shared lock.
  trap - EXIT INT TERM HUP
  exec "${RUN[@]}"
fi
# Host namespace: stay around to unmount. The command decides what a signal
# means (an interactive shell survives Ctrl-C); handlers, unlike ignored
# signals, are reset in the child.
trap ':' INT TERM HUP
rc=0
"${RUN[@]}" 9>&- || rc=$?
exit "$rc"
