#!/usr/bin/env python3
"""Fails when CHANGELOG.md's releases and CMakeLists.txt's version disagree (the ctest `docs.release`).

A release is a dated section of CHANGELOG.md, `## X.Y.Z (YYYY-MM-DD)`, under at most one
`## Unreleased` above them all; CMakeLists.txt's `project(ampx VERSION X.Y.Z)` (whence
`ampx::version()`) is the newest release's version until the next release raises both. The
releases run newest first: versions falling, dates not rising.

  scripts/check-release.py [--root DIR]

Standard library only. Prints each disagreement and exits 1 if there is one.
"""

import argparse
import datetime
import pathlib
import re
import sys

SECTION = re.compile(r"^## (.*)$")
RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+) \((\d{4}-\d{2}-\d{2})\)$")
PROJECT = re.compile(r"project\(ampx VERSION (\d+)\.(\d+)\.(\d+)\b")


def problems(root):
    """The disagreements, as lines."""
    out, releases = [], []
    lines = (root / "CHANGELOG.md").read_text(encoding="utf-8").splitlines()
    fenced, seen_section = False, False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else SECTION.match(line)
        if not m:
            continue
        title = m.group(1)
        first, seen_section = not seen_section, True
        if title == "Unreleased":
            if not first:
                out.append(f"CHANGELOG.md:{number}: '## Unreleased' must be the first section")
            continue
        r = RELEASE.match(title)
        if not r:
            out.append(f"CHANGELOG.md:{number}: '## {title}' is neither 'Unreleased' nor "
                       "'X.Y.Z (YYYY-MM-DD)'")
            continue
        try:
            date = datetime.date.fromisoformat(r.group(4))
        except ValueError:
            out.append(f"CHANGELOG.md:{number}: '{r.group(4)}' is not a date")
            continue
        version = tuple(int(g) for g in r.groups()[:3])
        if releases and not (version < releases[-1][0] and date <= releases[-1][1]):
            out.append(f"CHANGELOG.md:{number}: {title} is not older than the release above it")
        releases.append((version, date))
    p = PROJECT.search((root / "CMakeLists.txt").read_text(encoding="utf-8"))
    if not p:
        return out + ["CMakeLists.txt: no 'project(ampx VERSION X.Y.Z'"]
    cmake = tuple(int(g) for g in p.groups())
    if releases and releases[0][0] != cmake:
        out.append("CMakeLists.txt: version {} is not the newest release's, {}".format(
            ".".join(map(str, cmake)), ".".join(map(str, releases[0][0]))))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=pathlib.Path(__file__).resolve().parent.parent,
                        type=pathlib.Path)
    found = problems(parser.parse_args().root)
    for line in found:
        print(line)
    print(f"check-release: {len(found)} disagreement(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
