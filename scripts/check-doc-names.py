#!/usr/bin/env python3
"""Fails when README.md or a page under docs/ names something that is not there.

What it checks, in README.md and docs/**/*.md (the ctest `docs.names`):

- `scripts/...`: every script named anywhere in the text exists;
- repository paths in code (`src/...`, `tests/...`, `cmake/...`, `ampx/x.h`
  for `include/ampx/x.h`, ...), as inline code or in a fenced block;
- links to files (`[text](docs/x.md)`, relative to the page) and their
  anchors (`#section`, GitHub's slug of a heading of the page linked);
- `make <target>`: a target of the Makefile;
- ampx-train's flags: those after `ampx-train` or in `RUN_ARGS=` in code,
  and inline code that starts with a flag, which must be ampx-train's
  (parsed from CLI11's add_option/add_flag in apps/ampx-train/**/*.cpp, or from
  `--help` of a built binary given as --ampx-train PATH) or a flag of one of
  the repository's own scripts (scripts/, bench/, tests/helpers/).

  scripts/check-doc-names.py [--root DIR] [--ampx-train build/host/apps/ampx-train/ampx-train]

Standard library only. Prints each stale name as FILE:LINE: what, and exits
1 if there is one.
"""

import argparse
import pathlib
import re
import subprocess
import sys

TOP_DIRS = ("apps", "bench", "cmake", "docs", "examples", "include", "scripts", "src", "tests")
ROOT_FILES = ("Makefile", "CMakeLists.txt", "README.md", "CHANGELOG.md", ".clang-format")
# Flags of tools that are not ampx's, as the docs quote them.
OTHER_TOOLS_FLAGS = {
    "--gtest_filter", "--no-python", "--no_python", "--nproc-per-node", "--nproc_per_node",
    "--output-on-failure", "--build", "--install", "--prefix", "--no-install-recommends",
    "--benchmark_filter", "--benchmark_repetitions", "--nnodes", "--node-rank", "--rdzv-endpoint",
    "--rdzv-backend", "--rdzv-id", "--master-addr", "--master-port", "--ntasks", "--ntasks-per-node",
    "--nodes", "--cpus-per-task", "--oversubscribe", "--bind-to", "--hostfile", "--host",
    "-np", "--help", "--version", "--target", "--config", "--parallel",
    "--fmad",  # nvcc
    "--signal",  # Slurm's sbatch
}


def ampx_train_flags_from_sources(root):
    flags = set()
    pattern = re.compile(r'add_(?:option|flag)\(\s*"([^"]+)"')
    for source in sorted((root / "apps" / "ampx-train").rglob("*.cpp")):
        for spec in pattern.findall(source.read_text(encoding="utf-8")):
            for name in spec.split(","):
                name = re.sub(r"\{.*\}", "", name.strip()).lstrip("!")
                if name.startswith("--"):
                    flags.add(name)
    return flags | {"--help"}  # CLI11's own


def ampx_train_flags_from_binary(binary):
    text = subprocess.run([binary, "--help"], capture_output=True, text=True, check=False).stdout
    return set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", text))


def script_flags(root):
    """Flags the repository's own scripts and programs take or pass on."""
    flags = set()
    folders = [root / "scripts", root / "bench", root / "tests" / "helpers"]
    for folder in folders:
        if not folder.is_dir():
            continue
        for path in folder.rglob("*"):
            if path.suffix in (".sh", ".py", ".cpp") and path.is_file():
                text = path.read_text(encoding="utf-8", errors="replace")
                flags.update(re.findall(r"(--[a-z0-9][a-z0-9_-]*)", text))
    return flags


def make_targets(root):
    text = (root / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([a-zA-Z0-9][a-zA-Z0-9_-]*)\s*:(?!=)", text, re.M))


def slug(heading):
    """GitHub's anchor of a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        found, counts, fenced = set(), {}, False
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("```"):
                fenced = not fenced
            if fenced:
                continue
            m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                base = slug(m.group(1))
                n = counts.get(base, 0)
                found.add(base if n == 0 else f"{base}-{n}")
                counts[base] = n + 1
        cache[path] = found
    return cache[path]


class Page:
    """A Markdown page split into prose, inline code spans and fenced blocks."""

    def __init__(self, path):
        self.path = path
        self.lines = path.read_text(encoding="utf-8").splitlines()
        self.code = []  # (line number, text, is_fenced)
        self.prose = []  # (line number, text)
        fenced, block, start = False, [], 0
        for n, line in enumerate(self.lines, 1):
            if line.lstrip().startswith("```"):
                if fenced:
                    self.code.append((start, "\n".join(block), True))
                    block = []
                else:
                    start = n + 1
                fenced = not fenced
                continue
            if fenced:
                block.append(line)
            else:
                self.prose.append((n, line))
        # Inline code may wrap once: join each prose line with the next.
        text = "\n".join(line for _, line in self.prose)
        numbers = [n for n, _ in self.prose]
        for m in re.finditer(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)", text):
            self.code.append((numbers[text.count("\n", 0, m.start())], m.group(1), False))


def check(root, train_flags):
    pages = [root / "README.md"] + sorted((root / "docs").rglob("*.md"))
    targets = make_targets(root)
    own_flags = script_flags(root)
    errors = []

    def fail(page, line, what):
        errors.append(f"{page.path.relative_to(root)}:{line}: {what}")

    def path_exists(token):
        token = token.rstrip(".,;:)'\"")
        if any(c in token for c in "<>*{}$") or "..." in token:
            return True  # a pattern, not a name
        if token.startswith("ampx/") and token.endswith(".h"):
            return (root / "include" / token).exists()
        return (root / token).exists()

    for path in pages:
        page = Page(path)
        # Scripts, anywhere in the text.
        for n, line in enumerate(page.lines, 1):
            for m in re.finditer(r"(?<![\w/.-])scripts/[\w./-]*[\w]", line):
                if not path_exists(m.group(0)):
                    fail(page, n, f"no such script: {m.group(0)}")
        # Links to files, and their anchors.
        for n, line in page.prose:
            for m in re.finditer(r"\]\(([^)\s]+)\)", line):
                target = m.group(1)
                if re.match(r"^[a-z]+:", target):
                    continue
                file_part, _, anchor = target.partition("#")
                linked = (path.parent / file_part).resolve() if file_part else path
                if not linked.exists():
                    fail(page, n, f"link to a missing file: {target}")
                elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                    fail(page, n, f"link to a missing section: {target}")
        # Names in code: paths, make targets, ampx-train's flags.
        for n, code, fenced in page.code:
            for token in re.findall(r"[^\s`(\[]+", code):
                head = token.split("/")[0]
                if head == "scripts":
                    continue  # checked above, in the whole text
                if (head in TOP_DIRS and "/" in token) or token in ROOT_FILES or \
                        (token.startswith("ampx/") and token.rstrip(".,;:)").endswith(".h")):
                    if not path_exists(token):
                        fail(page, n, f"no such file: {token}")
            for m in re.finditer(r"(?<![\w-])make\s+((?:[A-Z_]+=\S+\s+)*)([a-z][a-z0-9-]*)", code):
                if m.group(2) not in targets:
                    fail(page, n, f"no such make target: make {m.group(2)}")
            segments = re.findall(r"RUN_ARGS=([^;&\n`]*)", code)
            for m in re.finditer(r"(?<!\S)\S*ampx-train(?![\w./-])([^;&\n`]*)", code):
                before = code[:m.start()].split()
                if not (before and before[-1].startswith("--")):  # a value of another tool's flag
                    segments.append(m.group(1))
            if not fenced and code.lstrip().startswith("--"):
                segments.append(code)
            for segment in segments:
                for flag in re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9_-]*)", segment):
                    if flag in train_flags:
                        continue
                    if segment is code and not fenced and (flag in own_flags or flag in OTHER_TOOLS_FLAGS):
                        continue
                    fail(page, n, f"not a flag of ampx-train: {flag}")
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=pathlib.Path(__file__).resolve().parent.parent, type=pathlib.Path)
    parser.add_argument("--ampx-train", help="a built ampx-train, whose --help gives the flags")
    args = parser.parse_args()
    root = args.root.resolve()
    flags = ampx_train_flags_from_binary(args.ampx_train) if args.ampx_train \
        else ampx_train_flags_from_sources(root)
    if not flags:
        print("check-doc-names: found no ampx-train flags", file=sys.stderr)
        return 1
    errors = check(root, flags)
    for e in errors:
        print(e)
    pages = 1 + len(list((root / "docs").rglob("*.md")))
    print(f"check-doc-names: {pages} pages, {len(errors)} stale name(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
