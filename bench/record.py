"""Where run_all.py's report goes: one run of record per kind of CPU, the latest.

    kind = cpu_kind()                 # {"kind": "amx", "label": "AMX: ...", "isa": [...], ...}
    files = record_files("docs/PERFORMANCE.md", "amx")
    files["main"]                     # docs/performance/cpu-amx.md
    write_record(files, data, main_lines, parts_lines, json_text)

The kind is what decides how a CPU runs bf16 products (LibTorch's oneDNN kernels, AMX's
tiles, or a scalar loop), read from /proc/cpuinfo's flags: the same code and the same
targets give different ratios on each, so each kind keeps its own run. A run writes its
kind's files under docs/performance/ and its row of the index, docs/PERFORMANCE.md's table
of runs of record; the other kinds' files and rows stay as they are:

  docs/PERFORMANCE.md                 the index: one row per kind (generated), then what is
                                      written by hand below KEPT_MARK (kept)
  docs/performance/cpu-KIND.md        the machine, the targets, end to end, what each side
                                      ran, where the step goes
  docs/performance/cpu-KIND-parts.md  FP8 against torchao, micro-benchmarks, data parallel,
                                      numerics diagnostics, sharding, attention by shape
  docs/performance/cpu-KIND.json      every number of the run

Each .md keeps what follows KEPT_MARK in its previous version. Two files a run keep each under
docs/'s 500 lines (scripts/check-doc-lengths.py). Only the standard library.
"""
import os
import re

from harness import ROOT

# Sections written by hand below this line of a page make bench writes; make bench keeps them.
KEPT_MARK = "<!-- make bench keeps what follows: runs on other machines -->"

# (kind, the /proc/cpuinfo flag that makes it, what it is), the first that matches wins
KINDS = [
    ("amx", "amx_bf16", "AMX: AVX-512 with BF16 and AMX's bf16 tiles"),
    ("avx512-fp16", "avx512_fp16", "AVX512-BF16 and AVX512-FP16, no AMX"),
    ("avx512-bf16", "avx512_bf16", "AVX512-BF16, no AVX512-FP16, no AMX"),
    ("avx512", "avx512f", "AVX-512 without BF16"),
    ("avx2", "avx2", "AVX2, no AVX-512"),
]
# The flags the report lists, as Intel names them
ISA_NAMES = [("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"),
             ("avx512_fp16", "AVX512-FP16"), ("amx_bf16", "AMX-BF16")]

INDEX_TITLE = "# ampx performance"
RUNS_HEADING = "## Runs of record, one per kind of CPU"
ROW_HEAD = "| kind | instruction sets | run of record | machine | targets | files |"


def cpu_kind(cpuinfo="/proc/cpuinfo", override=None):
    """The CPU's kind, its label, model name and listed instruction sets; override (run_all's
    --cpu-kind) names the kind instead of the flags."""
    model, flags = None, set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    labels = {k: label for k, _, label in KINDS}
    if override:
        kind = override
    else:
        kind = next((k for k, flag, _ in KINDS if flag in flags), None)
        kind = kind or re.sub(r"[^a-z0-9-]", "-", (os.uname().machine or "unknown").lower())
    return {"kind": kind, "label": labels.get(kind, kind), "model": model,
            "isa": [name for flag, name in ISA_NAMES if flag in flags]}


def record_files(index, kind, json_path=None):
    """The paths a run of this kind writes: main, parts, json (json_path if given)."""
    folder = os.path.join(os.path.dirname(os.path.abspath(index)), "performance")
    stem = os.path.join(folder, "cpu-" + kind)
    return {"index": index, "main": stem + ".md", "parts": stem + "-parts.md",
            "json": json_path or stem + ".json"}


def shown(path):
    """A path as the report names it: from the repository's root where it is inside it."""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    return path if rel.startswith("..") else rel


def link(from_file, to_file):
    return os.path.relpath(os.path.abspath(to_file), os.path.dirname(os.path.abspath(from_file)))


def kept_sections(path):
    """The text from KEPT_MARK to the end of the page's previous version, if it has the mark."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    at = text.find(KEPT_MARK)
    return "" if at < 0 else "\n" + text[at:]


def targets_cell(targets):
    met = sum(1 for t in targets if t["value"] is not None and t["met"])
    measured = sum(1 for t in targets if t["value"] is not None)
    return f"{met} of {measured} met" + (f" ({len(targets) - measured} not measured)"
                                         if measured < len(targets) else "")


def index_row(data, files):
    m, k = data["machine"], data["machine"]["kind"]
    index = files["index"]
    return (f"| `{k['kind']}` | {', '.join(k['isa']) or 'none listed'} | {data['date']}, commit "
            f"{data['commit']} | {m['cpu']}, {m['cores']} cores | {targets_cell(data['targets'])} "
            f"| [cpu-{k['kind']}.md]({link(index, files['main'])}), "
            f"[parts]({link(index, files['parts'])}), [json]({link(index, files['json'])}) |")


def index_rows(path):
    """{kind: row} of the index's table of runs, from its previous version."""
    rows = {}
    try:
        with open(path) as f:
            lines = f.read().split(KEPT_MARK)[0].splitlines()
    except OSError:
        return rows
    for line in lines:
        m = re.match(r"^\| `([^`]+)` \|", line)
        if m:
            rows[m.group(1)] = line
    return rows


def index_page(path, row, kind):
    """The index: this kind's row replaced (or added), the others kept, kinds in KINDS' order."""
    rows = index_rows(path)
    rows[kind] = row
    order = [k for k, _, _ in KINDS]
    ranked = sorted(rows, key=lambda k: (order.index(k) if k in order else len(order), k))
    lines = [INDEX_TITLE, "",
             "`make bench` (`bench/run_all.py`) keeps one run of record per kind of CPU, the "
             "latest: a run writes its kind's files under `docs/performance/` and its row below, "
             "and leaves the other kinds' as they are. The kind is what decides how the CPU runs "
             "bf16 products (oneDNN's AVX512-BF16 kernels, AMX's tiles, or a scalar loop), read "
             "from `/proc/cpuinfo`'s flags (`bench/run_all.py --cpu-kind` names it instead); "
             "the same targets are checked on each. Each run has three files: `cpu-KIND.md` (the "
             "machine, the command, the targets, end to end against PyTorch's wheel and Debian's "
             "Python, what each side ran, where the step goes), `cpu-KIND-parts.md` (FP8 "
             "against torchao, micro-benchmarks, data parallel, numerics diagnostics, sharding, "
             "attention by shape: what of them the run ran) and `cpu-KIND.json` (every number). "
             "The machines are shared and noisy: compare ratios within one run, not numbers "
             "across runs or kinds.", "",
             RUNS_HEADING, "", ROW_HEAD, "| --- | --- | --- | --- | --- | --- |"]
    lines += [rows[k] for k in ranked]
    return "\n".join(lines) + "\n"


def write(path, text):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_record(files, data, main_lines, parts_lines, json_text):
    """The run's two pages and its JSON, then its row of the index; each page keeps its own
    hand-written part."""
    kind = data["machine"]["kind"]["kind"]
    for key, lines in (("main", main_lines), ("parts", parts_lines)):
        write(files[key], "\n".join(lines) + "\n" + kept_sections(files[key]))
    write(files["json"], json_text)
    index = files["index"]
    write(index, index_page(index, index_row(data, files), kind) + kept_sections(index))
