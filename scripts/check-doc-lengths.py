#!/usr/bin/env python3
"""Fails when README.md or a page under docs/ is longer than its limit (the ctest `docs.lengths`).

Issue 66: the README is a front page, at most 300 lines; every page under docs/ (docs/**/*.md)
a reference of at most 500 lines. A page that grows past its limit is split by topic, or its
history goes (studies into docs/studies/, still under the limit).

  scripts/check-doc-lengths.py [--root DIR]

Standard library only. Prints each page over its limit as FILE: N lines, over its limit of M,
and exits 1 if there is one.
"""

import argparse
import pathlib
import sys

README_LIMIT = 300
DOCS_LIMIT = 500


def pages(root):
    """(page, its limit) for README.md and every docs/**/*.md."""
    found = [(root / "README.md", README_LIMIT)] if (root / "README.md").exists() else []
    return found + [(p, DOCS_LIMIT) for p in sorted((root / "docs").rglob("*.md"))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=pathlib.Path(__file__).resolve().parent.parent,
                        type=pathlib.Path)
    root = parser.parse_args().root.resolve()
    checked, over = 0, 0
    for page, limit in pages(root):
        n = len(page.read_text(encoding="utf-8").splitlines())
        checked += 1
        if n > limit:
            over += 1
            print(f"{page.relative_to(root)}: {n} lines, over its limit of {limit}")
    print(f"check-doc-lengths: {checked} pages, {over} over the limit")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
