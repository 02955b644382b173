#!/usr/bin/env bash
# Builds ampx's API reference from the public headers' comments with Doxygen
# (docs/Doxyfile) into OUT_DIR/html, and fails on any Doxygen warning (an
# undocumented public symbol, a broken \ref, an unknown command) and on a
# header or namespace without documentation, which Doxygen does not report.
# Used by `make docs` and by the ctest docs.reference.
#
#   scripts/docs.sh build/docs        # -> build/docs/html/index.html
#
# DOXYGEN names the doxygen to run (default: the one on PATH).
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: scripts/docs.sh OUT_DIR" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1"
out=$(cd "$1" && pwd)
doxygen=${DOXYGEN:-doxygen}
command -v "$doxygen" >/dev/null 2>&1 || {
  echo "ampx docs: doxygen not found ('$doxygen'); scripts/install-deps.sh installs it" >&2
  exit 1
}

# version.h is generated from version.h.in, as CMake does, from the one
# place the version is written.
version=$(sed -n 's/^project(ampx VERSION \([0-9][0-9.]*\).*/\1/p' "$root/CMakeLists.txt")
if [ -z "$version" ]; then
  echo "ampx docs: no 'project(ampx VERSION x.y.z' in $root/CMakeLists.txt" >&2
  exit 1
fi
IFS=. read -r major minor patch <<<"$version"
rm -rf "$out/html" "$out/xml" "$out/include"
mkdir -p "$out/include/ampx"
sed -e "s/@PROJECT_VERSION@/$version/g" -e "s/@PROJECT_VERSION_MAJOR@/$major/g" \
  -e "s/@PROJECT_VERSION_MINOR@/$minor/g" -e "s/@PROJECT_VERSION_PATCH@/$patch/g" \
  "$root/include/ampx/version.h.in" >"$out/include/ampx/version.h"

log="$out/warnings.log"
rm -f "$log"
status=0
(cd "$root" && AMPX_SOURCE_DIR="$root" AMPX_DOCS_OUT="$out" AMPX_VERSION="$version" \
  "$doxygen" docs/Doxyfile) || status=$?
# Doxygen's exit status alone is not trusted: the log must be empty too.
if [ "$status" -ne 0 ] || [ -s "$log" ]; then
  echo "ampx docs: doxygen failed (exit status $status); its warnings ($log):" >&2
  sed "s|$root/||" "$log" | awk '!seen[$0]++' >&2 || true
  exit 1
fi

# Doxygen does not warn about a header without \file documentation (its page
# would lack the header's opening example) or an undocumented namespace.
python3 - "$out/xml" <<'EOF'
import pathlib, sys
import xml.etree.ElementTree as ET

missing = []
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.xml")):
    root = ET.parse(path).getroot()
    for c in root.iter("compounddef"):
        kind, name = c.get("kind"), c.findtext("compoundname")
        if kind == "file" and not name.endswith(".h"):
            continue  # the main page
        if kind == "namespace" and (name.split("::")[0] != "ampx" or "detail" in name.split("::")):
            continue  # LibTorch's, forward-declared; ampx's internals
        if kind not in ("file", "namespace"):
            continue
        text = "".join("".join(c.find(d).itertext()) for d in ("briefdescription", "detaileddescription"))
        if not text.strip():
            missing.append(f"{kind} {name} is not documented")
if missing:
    print("ampx docs: " + "; ".join(missing) + " (each header opens with a /// \\file block, each namespace has a /// comment)",
          file=sys.stderr)
    sys.exit(1)
EOF
echo "ampx docs: API reference in $out/html/index.html"
