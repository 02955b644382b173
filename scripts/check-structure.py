#!/usr/bin/env python3
"""Fails when ampx's C++ gets a new structure debt (the ctest `structure`, issue 66).

The rules, over the project's own C++ (include/, src/, apps/, bench/, examples/, tests/):

- file: no source file over 500 lines;
- function: no function over 80 lines, lambdas and test bodies included, as
  Universal Ctags measures them (Debian's universal-ctags; its `end` field);
- include: includes point down the layer table (scripts/structure-layers.txt,
  the one place that ranks the folders): into the file's own folder or into
  a folder of a lower layer, never up nor into a peer of the same layer;
- cycle: no cycle of includes between the table's folders, whatever their layers.

What breaks a rule today is listed in scripts/structure-debts.txt, each file
and function with its size. The check is a ratchet: it fails on a violation
not listed, on a listed file or function grown past its number, and on a
listed debt that is gone (trim its line, or run with --update). A listed one
that shrank is reported; its number may be lowered (--update does).

  scripts/check-structure.py [--root DIR] [--ctags PATH] [--update] [--current]

--update rewrites scripts/structure-debts.txt with the lines of fixed debts
removed and the numbers of shrunk ones lowered (it never adds nor raises one);
--current prints every violation of today in that file's format.

Standard library only, and the ctags program. Prints each error as FILE:LINE:
what [rule], then a summary line, and exits 1 if there is an error.
"""

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

FILE_LIMIT = 500
FUNCTION_LIMIT = 80
SCANNED = ("include", "src", "apps", "bench", "examples", "tests")
EXTENSIONS = (".h", ".hh", ".hpp", ".inl", ".c", ".cc", ".cpp", ".cxx", ".cu", ".cuh")
# Folders that are not ampx's own code: build trees, caches, vendored sources.
SKIPPED_DIRS = ("build", "third_party", "third-party", "external", "vendor", "__pycache__")
# Where an include is looked for after the including file's own folder: what
# CMake's target_include_directories give ampx (include/), its own programs
# (src/, through the ampx_internal target) and ampx-train's and the workloads'
# users (apps/ampx-train, apps/workloads). An include found in none (a system
# header, ampx/version.h generated into the build tree) is not ampx's folder graph.
INCLUDE_ROOTS = ("include", "src", "apps/ampx-train", "apps/workloads")
LAYERS_FILE = "scripts/structure-layers.txt"
DEBTS_FILE = "scripts/structure-debts.txt"
CTAGS_PACKAGE = "universal-ctags"
RULES = ("file", "function", "include", "cycle")
SIZED = ("file", "function")

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]')


class Failure(Exception):
    """A problem with the check's own inputs: the tool, the table, the debts list."""


def sources(root):
    """The project's C++ files, as sorted paths relative to root ('src/fp8/cast.cpp')."""
    found = []
    for top in SCANNED:
        for folder, dirs, files in os.walk(root / top):
            dirs[:] = [d for d in dirs if not d.startswith(".") and not d.startswith("build")
                       and d not in SKIPPED_DIRS]
            for name in files:
                if name.endswith(EXTENSIONS):
                    found.append((pathlib.Path(folder) / name).relative_to(root).as_posix())
    return sorted(found)


def read_layers(root):
    """The layer table: [(folder, layer, line number)], `src/*` kept as written."""
    table, seen = [], set()
    path = root / LAYERS_FILE
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) < 2 or not fields[0].isdigit():
            raise Failure(f"{LAYERS_FILE}:{number}: expected 'LAYER FOLDER [what]', got '{line}'")
        folder = fields[1].rstrip("/")
        if folder in seen:
            raise Failure(f"{LAYERS_FILE}:{number}: {folder} is listed twice")
        seen.add(folder)
        table.append((folder, int(fields[0]), number))
    return table


def folder_of(path, table):
    """The table's folder that holds path: the longest one; None where none does."""
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    best = None
    for folder, _, _ in table:
        if folder.endswith("/*"):
            holds = parent == folder[:-2]
        else:
            holds = parent == folder or parent.startswith(folder + "/")
        if holds and (best is None or len(folder) > len(best)):
            best = folder
    return best


def resolve(path, spelled, quoted, known):
    """The project file an include names, as the compiler finds it; None outside the project."""
    candidates = [os.path.join(os.path.dirname(path), spelled)] if quoted else []
    candidates += [os.path.join(r, spelled) for r in INCLUDE_ROOTS]
    for candidate in candidates:
        candidate = os.path.normpath(candidate).replace(os.sep, "/")
        if candidate in known:
            return candidate
    return None


def find_ctags(given):
    """The Universal Ctags program: --ctags, else ctags-universal, universal-ctags or ctags."""
    names = [given] if given else ["ctags-universal", "universal-ctags", "ctags"]
    for name in names:
        program = shutil.which(name)
        if not program:
            continue
        version = subprocess.run([program, "--version"], capture_output=True, text=True,
                                 check=False).stdout
        if "Universal Ctags" in version:
            return program
        if given:
            raise Failure(f"{given} is not Universal Ctags (the Debian package {CTAGS_PACKAGE}; "
                          "scripts/install-deps.sh installs it)")
    raise Failure(f"Universal Ctags not found (the Debian package {CTAGS_PACKAGE}; "
                  "scripts/install-deps.sh installs it)")


def ctags_tags(root, ctags, paths):
    """Universal Ctags' function and namespace tags of paths, read as C++ (.cu too)."""
    command = [ctags, "--language-force=C++", "--kinds-C++=fn", "--fields=+neS", "--sort=no",
               "--output-format=json", "-o", "-", "-L", "-"]
    run = subprocess.run(command, cwd=root, input="\n".join(paths) + "\n", capture_output=True,
                         text=True, check=False)
    if run.returncode != 0:
        raise Failure(f"{ctags} failed (exit {run.returncode}): {run.stderr.strip()}")
    tags = []
    for line in run.stdout.splitlines():
        tag = json.loads(line)
        if tag.get("_type") == "tag":
            tags.append(tag)
    return tags


def function_names(tags):
    """{(path, line): name} for each function tag: classes kept, namespaces dropped
    (ModeRun::ModeRun), lambdas as 'train::(lambda)', test macros with their arguments
    (TEST(Suite,Name)); overloads get their signature, and twins ([2]) their order."""
    namespaces = {(t["path"], (t["scope"] + "::" if t.get("scope") else "") + t["name"])
                  for t in tags if t["kind"] == "namespace"}
    plain = {}
    for t in tags:
        if t["kind"] != "function":
            continue
        parts, prefix = [], ""
        for part in t.get("scope", "").split("::") if t.get("scope") else []:
            prefix = prefix + "::" + part if prefix else part
            if not part.startswith("__anon") and (t["path"], prefix) not in namespaces:
                parts.append(part)
        name = t["name"]
        if name.startswith("__anon"):
            name = "(lambda)"
        elif re.fullmatch(r"[A-Z][A-Z0-9_]*", name):
            name += t.get("signature", "")
        plain[(t["path"], t["line"])] = (" ".join("::".join(parts + [name]).split()),
                                         " ".join(t.get("signature", "").split()))
    names, seen = {}, {}
    counts = {}
    for (path, line), (name, _) in plain.items():
        counts[(path, name)] = counts.get((path, name), 0) + 1
    for (path, line), (name, signature) in sorted(plain.items()):
        if counts[(path, name)] > 1 and not name.endswith(")"):
            name += signature
        seen[(path, name)] = seen.get((path, name), 0) + 1
        names[(path, line)] = name if seen[(path, name)] == 1 else f"{name} [{seen[(path, name)]}]"
    return names


def strongly_connected(nodes, edges):
    """The strongly connected sets of folders with more than one folder (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


def violations(root, ctags):
    """Today's violations {(rule, key): (size, where, what)}, the other errors, and counts."""
    paths = sources(root)
    known = set(paths)
    table = read_layers(root)
    layer = {folder: n for folder, n, _ in table}
    found, errors = {}, []
    unplaced = {}
    edges, edge_lines = {}, {}
    for path in paths:
        text = (root / path).read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines()
        if len(lines) > FILE_LIMIT:
            found[("file", path)] = (len(lines), f"{path}:{FILE_LIMIT + 1}",
                                     f"{len(lines)} lines, over the limit of {FILE_LIMIT}")
        here = folder_of(path, table)
        if here is None:
            unplaced.setdefault(path.rsplit("/", 1)[0], path)
            continue
        for number, line in enumerate(lines, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            target = resolve(path, m.group(2), m.group(1) == '"', known)
            there = folder_of(target, table) if target else None
            if there is None or there == here:
                continue
            edges.setdefault(here, set()).add(there)
            edge_lines.setdefault((here, there), []).append(f"{path}:{number}")
            if layer[there] >= layer[here]:
                way = "up" if layer[there] > layer[here] else "into a peer of its layer"
                found.setdefault(("include", f"{path} -> {target}"), (
                    None, f"{path}:{number}",
                    f"includes {target}: {here} (layer {layer[here]}) -> {there} "
                    f"(layer {layer[there]}), {way}"))
    for folder, path in sorted(unplaced.items()):
        errors.append(f"{path}:1: its folder {folder}/ is in no line of {LAYERS_FILE} [include]")
    for component in strongly_connected(layer, edges):
        members = set(component)
        through = [f"{a} -> {b} ({edge_lines[(a, b)][0]}"
                   + (f" and {len(edge_lines[(a, b)]) - 1} more)" if len(edge_lines[(a, b)]) > 1
                      else ")")
                   for (a, b) in sorted(edge_lines) if a in members and b in members]
        first = edge_lines[min((a, b) for (a, b) in edge_lines if a in members and b in members)]
        found[("cycle", " ".join(component))] = (
            None, first[0], "folders that include each other: " + "; ".join(through))
    tags = ctags_tags(root, ctags, paths)
    names = function_names(tags)
    functions = [t for t in tags if t["kind"] == "function"]
    for t in functions:
        if "end" not in t:
            continue
        length = t["end"] - t["line"] + 1
        if length > FUNCTION_LIMIT:
            name = names[(t["path"], t["line"])]
            found[("function", f"{t['path']} {name}")] = (
                length, f"{t['path']}:{t['line']}",
                f"{name} is {length} lines, over the limit of {FUNCTION_LIMIT}")
    return found, errors, len(paths), len(functions)


def read_debts(root):
    """The listed debts {(rule, key): (size, line number)}."""
    debts = {}
    path = root / DEBTS_FILE
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        rule, _, rest = line.partition(" ")
        rest = " ".join(rest.split())
        if rule not in RULES or not rest:
            raise Failure(f"{DEBTS_FILE}:{number}: expected one of {', '.join(RULES)} and "
                          f"what, got '{line}'")
        size = None
        if rule in SIZED:
            rest, _, size = rest.rpartition(" ")
            if not size.isdigit() or not rest:
                raise Failure(f"{DEBTS_FILE}:{number}: a {rule} debt ends with its size in lines")
            size = int(size)
        if (rule, rest) in debts:
            raise Failure(f"{DEBTS_FILE}:{number}: {rule} {rest} is listed twice")
        debts[(rule, rest)] = (size, number)
    return debts


def debt_line(rule, key, size):
    return f"{rule:<9}{key}" + (f"  {size}" if size is not None else "")


def update(root, found, debts):
    """Drops the lines of fixed debts and lowers the numbers of shrunk ones."""
    path = root / DEBTS_FILE
    by_line = {number: (rule, key, size) for (rule, key), (size, number) in debts.items()}
    kept = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if number in by_line:
            rule, key, size = by_line[number]
            if (rule, key) not in found:
                continue
            now = found[(rule, key)][0]
            if size is not None and now < size:
                line = debt_line(rule, key, now)
        kept.append(line)
    path.write_text("\n".join(kept) + "\n", encoding="utf-8")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=pathlib.Path(__file__).resolve().parent.parent,
                        type=pathlib.Path)
    parser.add_argument("--ctags", help="the Universal Ctags program (default: found on PATH)")
    parser.add_argument("--update", action="store_true",
                        help=f"trim {DEBTS_FILE}: drop fixed debts, lower shrunk ones")
    parser.add_argument("--current", action="store_true",
                        help=f"print today's violations in {DEBTS_FILE}'s format")
    args = parser.parse_args()
    root = args.root.resolve()
    try:
        found, errors, n_files, n_functions = violations(root, find_ctags(args.ctags))
        if args.current:
            for rule in RULES:
                for (r, key), (size, _, _) in sorted(found.items()):
                    if r == rule:
                        print(debt_line(rule, key, size))
            return 0
        debts = read_debts(root)
    except Failure as e:
        print(f"check-structure: {e}")
        return 1
    fixed, notes = 0, []
    for (rule, key), (size, where, what) in sorted(found.items(), key=lambda i: i[1][1]):
        if (rule, key) not in debts:
            errors.append(f"{where}: {what} [{rule}]")
            continue
        listed, number = debts[(rule, key)]
        if size is not None and size > listed:
            errors.append(f"{where}: {what}, grown past the {listed} listed at "
                          f"{DEBTS_FILE}:{number}: split it [{rule}]")
        elif size is not None and size < listed and not args.update:
            notes.append(f"{DEBTS_FILE}:{number}: {rule} {key} is down from {listed} to {size}: "
                         "lower its number (--update)")
    for (rule, key), (size, number) in sorted(debts.items(), key=lambda i: i[1][1]):
        if (rule, key) not in found:
            fixed += 1
            if not args.update:
                errors.append(f"{DEBTS_FILE}:{number}: {rule} {key} is fixed: remove its line "
                              "(--update does)")
    if args.update:
        update(root, found, debts)
        notes.append(f"{DEBTS_FILE}: updated: fixed debts removed ({fixed}), shrunk ones lowered")
    for line in errors + notes:
        print(line)
    print(f"check-structure: {n_files} files, {n_functions} functions, {len(debts)} debts (listed), "
          f"{len(errors)} errors")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
