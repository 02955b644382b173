#!/usr/bin/env bash
# Runs a command inside a Debian 13 "trixie" chroot that has LibTorch 2.6
# (Debian's libtorch-dev), so ampx can be built and tested against LibTorch 2.6
# from a Debian 12 host (whose own libtorch-dev is 1.13).
#
#   scripts/trixie.sh <command...>   run <command> in the chroot, cwd /src
#   scripts/trixie.sh --ensure       only create / update the chroot
#
# The chroot lives outside the repository, in
#   ${AMPX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ampx}/trixie-root
# and is reused. It is built in a temporary directory next to that path and
# renamed into place only once fully provisioned; a stamp file inside it
# (/.ampx-packages) lists the installed packages, and packages added to
# PACKAGES below are installed on the next use.
#
# The repository root is bind-mounted at /src; /proc, /sys and /dev are
# bind-mounted too. All mounts are made in a private mount namespace, into
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
#   AMPX_CACHE_DIR               where the chroot lives (above)
#   AMPX_TRIXIE_MIRROR           Debian mirror; default: the one the host's own
#                                apt uses (/etc/apt/sources.list, sources.list.d/
#                                *.list and deb822 *.sources), so that a local
#                                mirror or caching proxy serves the chroot too;
#                                else http://deb.debian.org/debian
#   AMPX_TRIXIE_SECURITY_MIRROR  default: the host's security mirror when the
#                                host's mirror is used, else <mirror minus
#                                /debian>/debian-security
#   AMPX_TRIXIE_NO_NS=1          mount in the current namespace instead of a
#                                private one (debugging)
#   AMPX_APT_ETC                 read apt sources from here, not /etc/apt (tests)
# The host's apt proxy (Acquire::http::Proxy), if any, is used by debootstrap
# and by apt in the chroot. `scripts/trixie.sh --print-mirror` prints the
# mirrors and proxy it would use.
set -euo pipefail

SUITE=trixie
readonly FALLBACK_MIRROR=http://deb.debian.org/debian

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
MIRROR=${AMPX_TRIXIE_MIRROR:-${HOST_MIRROR:-$FALLBACK_MIRROR}}
MIRROR=${MIRROR%/}
# The host's security mirror goes with the host's mirror only.
HOST_SECURITY_MIRROR=""
if [ "$MIRROR" = "$HOST_MIRROR" ]; then HOST_SECURITY_MIRROR=$(host_debian_mirror security); fi
SECURITY_MIRROR=${AMPX_TRIXIE_SECURITY_MIRROR:-${HOST_SECURITY_MIRROR:-${MIRROR%/debian}/debian-security}}
APT_PROXY=$(host_apt_proxy)
PACKAGES=(
  build-essential cmake make
  libtorch-dev python3-torch python3-numpy
  libopenblas0-pthread libsleef-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  libcli11-dev nlohmann-json3-dev zlib1g-dev libgloo-dev
  ca-certificates iproute2
)
# Host variables passed into the chroot (besides AMPX_*).
KEEP_VARS=(CI TERM CMAKE_BUILD_PARALLEL_LEVEL CTEST_PARALLEL_LEVEL
           CTEST_OUTPUT_ON_FAILURE MAKEFLAGS OMP_NUM_THREADS)
STAMP_NAME=.ampx-packages

log() { printf 'ampx: %s\n' "$*" >&2; }
die() { printf 'ampx: error: %s\n' "$*" >&2; exit 1; }

usage() {
  cat >&2 <<'EOF'
usage: scripts/trixie.sh <command> [args...]   run a command in the Debian 13 chroot (cwd /src)
       scripts/trixie.sh --ensure              create or update the chroot only
       scripts/trixie.sh --print-mirror        print the mirrors and proxy it would use
EOF
}

# ---------------------------------------------------------------- arguments
ORIG_ARGS=("$@")
ENSURE_ONLY=0
case "${1:-}" in
  "") usage; exit 2 ;;
  -h|--help) usage; exit 0 ;;
  --ensure) [ $# -eq 1 ] || { usage; exit 2; }; ENSURE_ONLY=1 ;;
  --print-mirror)
    echo "mirror:   $MIRROR${AMPX_TRIXIE_MIRROR:+ (AMPX_TRIXIE_MIRROR)}"
    echo "security: $SECURITY_MIRROR"
    echo "proxy:    ${APT_PROXY:-none}"
    exit 0 ;;
  --) shift; [ $# -gt 0 ] || { usage; exit 2; } ;;
esac

# ---------------------------------------------------------------- host checks
if [ "$(id -u)" -ne 0 ]; then
  die "scripts/trixie.sh needs root (debootstrap, mount --bind and chroot); run it as root, e.g. 'sudo scripts/trixie.sh ...'"
fi
for tool in unshare flock chroot mount umount; do
  command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found on the host (Debian package util-linux / coreutils / mount)"
done

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
REPO=$(git -C "$SCRIPT_DIR" rev-parse --show-toplevel 2>/dev/null || true)
[ -n "$REPO" ] || REPO=$(cd "$SCRIPT_DIR/.." && pwd -P)

CACHE_DIR=${AMPX_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/ampx}
ROOT=$CACHE_DIR/trixie-root

# Re-execute in a private mount namespace: every mount made below is then
# invisible to the host and disappears with this process, whatever happens to
# it. If namespaces are unavailable (or AMPX_TRIXIE_NO_NS=1) we stay in the
# current namespace and rely on the cleanup trap (mounts are made rslave so
# unmounting never propagates back). AMPX_TRIXIE_IN_NS carries the outer
# namespace's id: we are in our own namespace only if ours differs from it and
# from our parent's (where readable; unshare execs without forking). A valid
# marker never leads to another unshare, so we re-execute at most once.
MY_NS=$(readlink /proc/self/ns/mnt 2>/dev/null || true)
PARENT_NS=$(readlink "/proc/$PPID/ns/mnt" 2>/dev/null || true)
OUTER_NS=${AMPX_TRIXIE_IN_NS:-}
unset AMPX_TRIXIE_IN_NS
IN_NS=0
if [[ $OUTER_NS =~ ^mnt:\[[0-9]+\]$ && $MY_NS =~ ^mnt:\[[0-9]+\]$ ]]; then
  if [ "$OUTER_NS" != "$MY_NS" ] && [ "$PARENT_NS" != "$MY_NS" ]; then
    IN_NS=1
  else
    log "note: not in a private mount namespace; mounts are removed on exit"
  fi
elif [ "${AMPX_TRIXIE_NO_NS:-0}" != 1 ] && [ -n "$MY_NS" ] &&
     unshare --mount --propagation private true 2>/dev/null; then
  export AMPX_TRIXIE_IN_NS=$MY_NS
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

write_stamp() {   # $1 = chroot dir, $2... = packages
  local r=$1; shift
  {
    echo "# ampx Debian $SUITE chroot, made by scripts/trixie.sh; installed packages:"
    printf '%s\n' "$@" | sort -u
  } >"$r/$STAMP_NAME.new"
  mv -f "$r/$STAMP_NAME.new" "$r/$STAMP_NAME"
}

read_stamp() { grep -v '^#' "$1/$STAMP_NAME" 2>/dev/null || true; }

create_chroot() {
  command -v debootstrap >/dev/null 2>&1 ||
    die "debootstrap not found on the host; install it with 'apt-get install debootstrap'"
  [ -e /usr/share/debootstrap/scripts/$SUITE ] ||
    die "this debootstrap does not know '$SUITE'; upgrade debootstrap"
  log "creating Debian 13 chroot in $ROOT (one-time, a few minutes)"
  local start=$SECONDS
  TMP_ROOT=$(mktemp -d "$ROOT.tmp.XXXXXX")
  chmod 755 "$TMP_ROOT"
  log "debootstrap $SUITE from $MIRROR"
  local dblog=$TMP_ROOT.debootstrap.log
  if ! env ${APT_PROXY:+http_proxy="$APT_PROXY"} \
      debootstrap --variant=minbase "$SUITE" "$TMP_ROOT" "$MIRROR" \
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
  cat >"$TMP_ROOT/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF
  if [ -n "$APT_PROXY" ]; then
    printf 'Acquire::http::Proxy "%s";\n' "$APT_PROXY" >"$TMP_ROOT/etc/apt/apt.conf.d/01ampx-proxy"
  fi
  mount_chroot_fs "$TMP_ROOT"
  log "installing ${PACKAGES[*]}"
  apt_install "$TMP_ROOT" "${PACKAGES[@]}"
  unmount_all
  write_stamp "$TMP_ROOT" "${PACKAGES[@]}"
  sync -f "$TMP_ROOT" 2>/dev/null || true
  mv -T "$TMP_ROOT" "$ROOT"
  TMP_ROOT=""
  log "chroot ready ($(du -sh --one-file-system "$ROOT" | cut -f1), $((SECONDS - start)) s)"
}

# Prints the packages of PACKAGES not listed in the chroot's stamp.
missing_packages() {
  local have p
  have=$(read_stamp "$ROOT")
  for p in "${PACKAGES[@]}"; do
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
  log "installing new packages into the chroot: ${missing[*]}"
  mount_chroot_fs "$ROOT"
  apt_install "$ROOT" "${missing[@]}"
  unmount_all
  # shellcheck disable=SC2086
  write_stamp "$ROOT" $have "${PACKAGES[@]}"
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
exec 9>"$CACHE_DIR/trixie-root.lock"
if ! flock -s -n 9; then
  log "waiting for another scripts/trixie.sh run to finish creating/updating the chroot"
  flock -s 9
fi
if needs_work; then
  if ! flock -x -n 9; then
    log "waiting for other scripts/trixie.sh runs to release the chroot"
    flock -x 9
  fi
  ensure_chroot
  flock -s 9
fi

if [ "$ENSURE_ONLY" -eq 1 ]; then exit 0; fi

ENV=(HOME=/root LANG=C.UTF-8
     PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)
for v in "${KEEP_VARS[@]}" $(compgen -e | grep '^AMPX_' || true); do
  case "$v" in AMPX_CACHE_DIR|AMPX_TRIXIE_*) continue ;; esac
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
